"""ollama Modelfile beside each GGUF: the ChatML template (training.text.chat_template.OLLAMA_TEMPLATE), its stop
strings and the context length. `Modelfile` itself points at the preferred type (Q4_K_M when present)."""

from __future__ import annotations

from pathlib import Path

from training.text.chat_template import OLLAMA_TEMPLATE, STOP_STRINGS

MODELFILE = "Modelfile"
PREFERENCE = ("Q4_K_M", "Q8_0", "F16", "F32")


def render(gguf_name: str, n_ctx: int) -> str:
    if '"""' in OLLAMA_TEMPLATE:
        raise ValueError("OLLAMA_TEMPLATE must not contain triple quotes (Modelfile quoting)")
    lines = [f"FROM ./{gguf_name}", f'TEMPLATE """{OLLAMA_TEMPLATE}"""']
    lines += [f'PARAMETER stop "{s}"' for s in STOP_STRINGS]
    lines.append(f"PARAMETER num_ctx {n_ctx}")
    return "\n".join(lines) + "\n"


def write_modelfiles(gguf_files: dict[str, Path], n_ctx: int) -> list[Path]:
    """`Modelfile.<TYPE>` for every GGUF and `Modelfile` for the preferred one; {type: path} in."""
    if not gguf_files:
        return []
    written = []
    for type_name, path in gguf_files.items():
        p = path.parent / f"{MODELFILE}.{type_name}"
        p.write_text(render(path.name, n_ctx), encoding="utf-8")
        written.append(p)
    best = next((t for t in PREFERENCE if t in gguf_files), next(iter(gguf_files)))
    main = gguf_files[best].parent / MODELFILE
    main.write_text(render(gguf_files[best].name, n_ctx), encoding="utf-8")
    return [main, *written]
