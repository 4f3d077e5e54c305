"""The raw bytes each token stands for, for backends that match grammars over bytes."""

from __future__ import annotations

import json
import re

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: printable stand-in character → byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def token_bytes(hf_tokenizer) -> dict[int, bytes]:
    """Bytes of every ordinary (non-special) token, keyed by id."""
    backend = json.loads(hf_tokenizer.backend_tokenizer.to_str())
    decoder = backend.get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", []) or []}
    special = set(hf_tokenizer.all_special_ids) | {t["id"] for t in backend.get("added_tokens", []) if t.get("special")}
    vocab = hf_tokenizer.get_vocab()
    out: dict[int, bytes] = {}
    if "ByteLevel" in kinds:
        alphabet = _byte_level_alphabet()
        for tok, tid in vocab.items():
            if tid in special:
                continue
            try:
                out[tid] = bytes(alphabet[c] for c in tok)
            except KeyError:  # an added non-byte-level token: take its text
                out[tid] = tok.encode()
        return out
    for tok, tid in vocab.items():  # SentencePiece style: '▁' is a space, <0xNN> a raw byte
        if tid in special:
            continue
        m = _BYTE_TOKEN.match(tok)
        out[tid] = bytes([int(m.group(1), 16)]) if m else tok.replace("▁", " ").encode()
    return out
