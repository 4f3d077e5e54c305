"""OpenAI's ``prediction`` (Predicted Outputs): the text a client expects, proposed as drafts."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from radixlm.runtime.protocol import Prediction


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
