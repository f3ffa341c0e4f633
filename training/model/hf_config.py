"""config.json of a Hugging Face Llama folder (`train.py --init-from`), read strictly.

Every field is honoured (read with its JSON type and range: `"tie_word_embeddings": "false"` is a
string, not True; `num_hidden_layers: true` is not 1 layer; `num_key_value_heads: 0` is not "all
heads"), ignored by reason (hf_import.IGNORED: bookkeeping that leaves the fp32 forward pass alone),
or refused by name. The two spellings of RoPE's settings (transformers 4: top-level rope_theta and
rope_scaling; transformers 5: rope_parameters) must agree wherever both are given, and anything
beyond an unscaled RoPE's theta (a factor, a scaled rope_type) is refused by name. The file is read
through the project's bounded JSON reader (training.runfiles.json_records), so a hostile nesting is one error line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, StrictBool, StrictInt, StrictStr

from training.runfiles.json_records import loads
from training.runfiles.schema import ConfigError, SchemaError, check

CONFIG = "config.json"
MAX_CONFIG_BYTES = 16 << 20  # a Llama config.json is a few KB; label maps and the like stay far below this
ARCHITECTURE, MODEL_TYPE = "LlamaForCausalLM", "llama"
PosInt = Annotated[StrictInt, Field(gt=0)]
TokenId = Annotated[StrictInt, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Share = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]

# field -> (type, LlamaConfig's default when absent; None: required). Checked strictly (no coercion).
SHAPE = {"vocab_size": "vocab_size", "hidden_size": "d_model", "intermediate_size": "ffn_dim",
         "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads"}
FIELDS: dict[str, tuple[Any, Any]] = {
    **{k: (PosInt, None) for k in SHAPE},
    "architectures": (list[StrictStr], None), "model_type": (StrictStr, None),
    "num_key_value_heads": (PosInt | None, None), "head_dim": (PosInt | None, None),
    "hidden_act": (StrictStr, "silu"), "max_position_embeddings": (PosInt, 2048),
    "rms_norm_eps": (PosFloat, 1e-6), "rope_theta": (PosFloat, 10000.0),
    "tie_word_embeddings": (StrictBool, False), "initializer_range": (Annotated[float, Field(ge=0, allow_inf_nan=False)], 0.02),
    "attention_bias": (StrictBool, False), "mlp_bias": (StrictBool, False), "attention_dropout": (Share, 0.0),
    "rope_scaling": (dict[StrictStr, Any] | None, None), "rope_parameters": (dict[StrictStr, Any] | None, None),
    "bos_token_id": (TokenId | None, None), "eos_token_id": (TokenId | list[TokenId] | None, None),
}
REQUIRED = {*SHAPE, "architectures", "model_type"}
DEFAULTS = {k: d for k, (_, d) in FIELDS.items() if k not in REQUIRED}
ROPE_SPELLINGS = ("rope_parameters", "rope_scaling")  # transformers 5's, transformers 4's
ROPE_KEYS = ("rope_type", "type", "rope_theta")  # all an unscaled RoPE has; anything else scales it
UNSCALED_ROPE = (None, "default")


class InitFromError(ConfigError):
    """A --init-from folder prodip cannot start from; the message names the file and field."""


def read_config(folder: Path) -> dict:
    """The folder's config.json as a dict (bounded read: size and nesting); InitFromError naming it otherwise."""
    path = folder / CONFIG
    if not path.is_file():
        raise InitFromError(f"--init-from {folder}: no {CONFIG}: not a Hugging Face model folder")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise InitFromError(f"{path}: {path.stat().st_size:,} bytes, more than a model config holds "
                            f"(at most {MAX_CONFIG_BYTES:,})")
    try:
        hf = loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, and the bounds' JSONBoundError
        raise InitFromError(f"{path}: not a JSON config ({e})") from None
    if not isinstance(hf, dict):
        raise InitFromError(f"{path}: not a JSON object")
    return hf


def checked_fields(hf: dict, path: Path) -> dict:
    """Every honoured field of `hf` checked by its type and range (strict: no coercion), defaults filled in."""
    out = dict(DEFAULTS)
    for name, (type_, _) in FIELDS.items():
        if name not in hf:
            if name in REQUIRED:
                raise InitFromError(f"{path}: field {name!r} is missing")
            continue
        try:
            out[name] = check(type_, hf[name], f"{path}: field {name}", strict=True)
        except SchemaError as e:
            raise InitFromError(str(e)) from None
    return out


def rope_theta(c: dict, given: dict, path: Path) -> float:
    """RoPE's theta from whichever spellings `given` (config.json as written) holds: each must describe an
    unscaled RoPE, and every theta given (top level, in rope_parameters, in rope_scaling) must agree."""
    thetas = {"rope_theta": c["rope_theta"]} if "rope_theta" in given else {}
    for where in ROPE_SPELLINGS:
        d = c[where] or {}
        kinds = {k: d[k] for k in ("rope_type", "type") if k in d}
        for k, kind in kinds.items():
            if kind not in UNSCALED_ROPE:
                raise InitFromError(f"{path}: {where} {k} {kind!r} cannot be honoured: prodip's model and its "
                                    "exports (HF, GGUF, ONNX) implement unscaled RoPE only")
        if len(set(kinds.values())) > 1:
            raise InitFromError(f"{path}: {where} says rope_type {kinds['rope_type']!r} and type {kinds['type']!r}: "
                                "they disagree")
        extra = [k for k in d if k not in ROPE_KEYS]
        if extra:
            raise InitFromError(f"{path}: {where}.{extra[0]} = {d[extra[0]]!r} cannot be honoured: prodip implements "
                                "unscaled RoPE only (rope_type default and its rope_theta); refusing rather than "
                                "dropping it")
        if "rope_theta" in d:
            try:
                thetas[f"{where}.rope_theta"] = check(PosFloat, d["rope_theta"], f"{path}: field {where}.rope_theta",
                                                      strict=True)
            except SchemaError as e:
                raise InitFromError(str(e)) from None
    if len(set(thetas.values())) > 1:
        given_ = ", ".join(f"{k} = {v!r}" for k, v in thetas.items())
        raise InitFromError(f"{path}: RoPE's theta is given twice and disagrees ({given_}); give one value")
    return next(iter(thetas.values()), DEFAULTS["rope_theta"])
