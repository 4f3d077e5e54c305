"""Request bodies of ``/v1/embeddings`` (OpenAI's), ``/v1/rerank`` (vLLM's and Jina's) and
``/v1/score`` (vLLM's). Fields a client commonly sends that we do not use (``user``) are ignored;
types and ranges are checked here, so a bad field is a 400 naming it."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

Salt = Annotated[str, Field(min_length=1)]
MAX_INSTRUCTION_CHARS = 4096


class _Body(BaseModel):
    """Unknown fields are ignored, as OpenAI's clients send some we do not use."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # echoed back; one model is served
    cache_salt: Salt | None = None  # the tenant: shares cached KV only within a salt


class EmbeddingRequest(_Body):
    """OpenAI's ``/v1/embeddings`` body."""

    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[StrictInt, Field(ge=1)] | None = None


class RerankDocument(BaseModel):
    """A document given as an object (Cohere's and Jina's form): only its text is read."""

    model_config = ConfigDict(extra="ignore")

    text: StrictStr


class RerankRequest(_Body):
    """vLLM's (and Jina's) ``/v1/rerank`` body."""

    query: StrictStr
    documents: Annotated[list[StrictStr | RerankDocument], Field(min_length=1)]
    top_n: Annotated[StrictInt, Field(ge=0)] = 0  # 0: every document
    return_documents: StrictBool = True
    instruction: Annotated[StrictStr, Field(max_length=MAX_INSTRUCTION_CHARS)] | None = None


class ScoreRequest(_Body):
    """vLLM's ``/v1/score`` body: ``text_1`` (the query, or one per ``text_2``) against ``text_2``."""

    text_1: StrictStr | Annotated[list[StrictStr], Field(min_length=1)]
    text_2: StrictStr | Annotated[list[StrictStr], Field(min_length=1)]
    instruction: Annotated[StrictStr, Field(max_length=MAX_INSTRUCTION_CHARS)] | None = None
