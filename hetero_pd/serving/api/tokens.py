"""vLLM's ``/tokenize`` and ``/detokenize`` bodies (pure functions; the API runs them on its
tokenizer thread).

``POST /tokenize``: ``{"model"?, "prompt": str, "add_special_tokens": true}`` or
``{"model"?, "messages": [...], "add_generation_prompt": true, "add_special_tokens":
false}``, and ``"return_token_strs"``; answers ``{"count", "max_model_len", "tokens",
"token_strs"}``. ``POST /detokenize``: ``{"model"?, "tokens": [ids]}``; answers
``{"prompt": text}``. ``model``, when given, must be a served name. Errors are 400s naming
the field, as for the other routes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hetero_pd.serving.api.errors import APIError, bad_request, model_not_found
from hetero_pd.serving.api.fields import json_object, opt_bool, parse_messages, show


def tokenize(
    tok: Any, body: Any, model_names: Sequence[str], max_model_len: int, max_chars: int
) -> dict[str, Any]:
    """The answer to a /tokenize body; ``max_chars`` (0: none) bounds the text, as for
    completions: longer text cannot be a prompt, so it is not worth tokenizer time."""
    b = json_object(body)
    check_model(b, model_names)
    strs = bool(opt_bool(b, "return_token_strs"))
    if b.get("messages") is not None:
        messages = parse_messages(b["messages"])
        _check_chars(sum(len(m["content"]) for m in messages), max_chars, "messages")
        if not getattr(tok, "chat_template", None):
            raise bad_request("this model has no chat template", "messages")
        generation = opt_bool(b, "add_generation_prompt")
        special = opt_bool(b, "add_special_tokens")
        text = tok.apply_chat_template(
            messages,
            add_generation_prompt=True if generation is None else generation,
            tokenize=False,
        )
        ids = list(tok.encode(text, add_special_tokens=bool(special)))
    else:
        prompt = b.get("prompt")
        if not isinstance(prompt, str):
            raise bad_request(
                f"'prompt' (a string) or 'messages' is required, got {show(prompt)}", "prompt"
            )
        _check_chars(len(prompt), max_chars, "prompt")
        special = opt_bool(b, "add_special_tokens")
        ids = list(tok.encode(prompt, add_special_tokens=special is not False))
    return {
        "count": len(ids),
        "max_model_len": max_model_len,
        "tokens": ids,
        "token_strs": list(tok.convert_ids_to_tokens(ids)) if strs else None,
    }


def detokenize(tok: Any, body: Any, model_names: Sequence[str], max_ids: int) -> dict[str, str]:
    """The answer to a /detokenize body: the ids' text (special tokens kept, as vLLM);
    at most ``max_ids`` ids (the model's context: no request makes more)."""
    b = json_object(body)
    check_model(b, model_names)
    ids = b.get("tokens")
    if not isinstance(ids, list):
        raise bad_request(f"'tokens' must be a list of token ids, got {show(ids)}", "tokens")
    if len(ids) > max_ids:
        raise too_many_ids(len(ids), max_ids)
    size = len(tok)
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < size]
    if bad:
        raise bad_request(
            f"'tokens' must be ids in the tokenizer's vocabulary [0, {size}), got "
            f"{[show(t) for t in bad[:5]]}",
            "tokens",
        )
    return {"prompt": str(tok.decode(ids))}


def too_many_ids(count: int, limit: int) -> APIError:
    return bad_request(
        f"'tokens' holds {count} ids, at most {limit} (this model's context: no request "
        "makes more text than that)",
        "tokens",
    )


def check_model(b: dict[str, Any], model_names: Sequence[str]) -> None:
    model = b.get("model")
    if model is not None and model not in model_names:
        raise (
            model_not_found(model)
            if isinstance(model, str)
            else bad_request(f"'model' must be a string, got {show(model)}", "model")
        )


def _check_chars(chars: int, max_chars: int, param: str) -> None:
    if max_chars and chars > max_chars:
        raise bad_request(
            f"the {param} has {chars} characters, more than any prompt this model can take "
            f"({max_chars})",
            param,
            "context_length_exceeded",
        )
