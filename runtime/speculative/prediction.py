"""OpenAI's ``prediction`` (Predicted Outputs): the text a client expects, proposed as drafts."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_CONTENT_PARTS = 1024  # parts one message or prediction may carry


class ContentPart(BaseModel):
    """A text part of a message's content or of a prediction (images are not supported)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's ``prediction`` (Predicted Outputs): the output the client expects."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["content"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)]

    def text(self) -> str:
        """The predicted text (parts joined)."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


def prediction_text(value: Any) -> str | None:
    """The predicted text of ``value``: a string, a ``Prediction``, or OpenAI's
    ``{"type": "content", "content": str | [{"type": "text", "text": str}, ...]}``.

    None stays None; any other shape is a ValueError naming the ``prediction`` field.
    """
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Prediction):
        return value.text()
    try:
        return Prediction.model_validate(value).text()
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(part) for part in ("prediction", *err["loc"]))
        raise ValueError(f"{where}: {err['msg']}") from None
