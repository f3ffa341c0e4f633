"""ONNX Runtime backend: serves the decoder `export.onnx.onnx_export` writes (fp32, int8 or int4), KV cache included.

The graph has optimum's decoder interface (`input_ids`, `attention_mask`, `position_ids`,
`past_key_values.N.key/value` -> `logits`, `present.N.key/value`), so one pass covers both the
prompt (empty past, length 0) and each decoding step (the presents fed back as the next past).
Batches may be padded on either side: `position_ids` carry each row's real positions (0..len-1),
`attention_mask` hides the pads (a pad query that sees nothing yields 0, not NaN), and a decoding step
appends one cache slot per row at position len. Left padding (HF's convention) is recorded in
onnx_config.json; docs/onnx.md shows both. Generation and `logits_incremental` run the one decode loop
(training.model.decode_loop) over `_step`, sampling through serving.backends.sampled_decode.

The folder beside the .onnx file holds `tokenizer.model` and `onnx_config.json`; a graph that does
not match them (other vocabulary, layer count or head shape, missing inputs) is refused.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from serving.backend import SamplingParams, ServingError
from serving.backends.sampled_decode import generate_ids
from training.model.decode_loop import feed
from training.runfiles.layout import LayoutError, read_json
from training.text.tokenizer import Tokenizer, TokenizerError

CONFIG_FILE = "onnx_config.json"
TOKENIZER_FILE = "tokenizer.model"
FORMAT = "prodip-onnx"
FORMAT_VERSION = 1
VARIANT_FILES: dict[str, str] = {"fp32": "model.onnx", "int8": "model-int8.onnx", "int4": "model-int4.onnx"}
PADDING_SIDE = "left"  # optimum/HF generation convention; right padding works too (tests cover both)
_ORT_TYPES = {"input_ids": "tensor(int64)", "attention_mask": "tensor(int64)", "position_ids": "tensor(int64)"}


def input_names(n_layers: int) -> list[str]:
    """optimum's decoder input names, in the order the exported graph takes them."""
    return ["input_ids", "attention_mask", "position_ids"] + [
        f"past_key_values.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]


def output_names(n_layers: int) -> list[str]:
    return ["logits"] + [f"present.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]


def read_config(folder: Path) -> dict:
    f = folder / CONFIG_FILE
    if not f.exists():
        raise ServingError(f"{f} not found: the ONNX folder was not written by prodip's export (export.onnx.onnx_export)")
    try:
        cfg = read_json(f, "ONNX config")
    except LayoutError as e:
        raise ServingError(str(e)) from None
    if cfg.get("format") != FORMAT:
        raise ServingError(f"{f}: not a prodip ONNX config (format {cfg.get('format')!r})")
    missing = [k for k in ("n_layers", "n_kv_heads", "head_dim", "vocab_size", "max_seq_len", "tokenizer_sha256")
               if k not in cfg]
    if missing:
        raise ServingError(f"{f}: missing keys {missing}")
    return cfg


class OnnxBackend:
    """`Backend` over onnxruntime's CPU provider; `path` is a .onnx file or the folder holding it."""

    def __init__(self, path: str | Path, *, threads: int | None = None, variant: str = "fp32"):
        import onnxruntime as ort  # imported here: `load()` users of other backends need not pay for it

        p = Path(path)
        if p.is_dir():
            if variant not in VARIANT_FILES:
                raise ServingError(f"unknown ONNX variant {variant!r}; choose one of {', '.join(VARIANT_FILES)}")
            folder, model_file = p, p / VARIANT_FILES[variant]
        else:
            folder, model_file = p.parent, p
            # the file name says which variant it is; an unknown name keeps the caller's label
            variant = {v: k for k, v in VARIANT_FILES.items()}.get(p.name, variant)
        if not model_file.is_file():
            raise ServingError(f"ONNX model not found: {model_file}")
        if threads is not None and threads < 1:
            raise ServingError(f"threads must be >= 1, got {threads}")
        self.config = read_config(folder)
        listed = self.config.get("files", {})
        if model_file.name in VARIANT_FILES.values() and model_file.name not in listed.values():
            raise ServingError(f"{model_file} is not part of the export in {folder} (onnx_config.json lists "
                               f"{', '.join(listed.values()) or 'no files'}); re-export with that variant")
        try:
            self.tokenizer = Tokenizer.load(folder / TOKENIZER_FILE)
        except TokenizerError as e:
            raise ServingError(str(e)) from None
        if self.tokenizer.sha256 != self.config["tokenizer_sha256"]:
            raise ServingError(f"{folder / TOKENIZER_FILE} is not the tokenizer this model was exported with")
        if self.tokenizer.vocab_size != self.config["vocab_size"]:
            raise ServingError(f"tokenizer has {self.tokenizer.vocab_size} tokens, onnx_config.json says "
                               f"{self.config['vocab_size']}")
        opts = ort.SessionOptions()
        if threads is not None:
            opts.intra_op_num_threads = threads
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            self.session = ort.InferenceSession(str(model_file), opts, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph types with C++ text
            raise ServingError(f"{model_file}: onnxruntime cannot load it ({str(e).splitlines()[0]})") from None
        self.path = model_file
        self.variant = variant
        self.name = f"onnx-{variant}"
        self.n_layers = int(self.config["n_layers"])
        self.n_kv_heads = int(self.config["n_kv_heads"])
        self.head_dim = int(self.config["head_dim"])
        self.vocab_size = int(self.config["vocab_size"])
        self.n_ctx = int(self.config["max_seq_len"])
        self.eos_ids = (self.tokenizer.eos_id, self.tokenizer.im_end_id)
        self._inputs = input_names(self.n_layers)
        self._outputs = output_names(self.n_layers)
        self._check_graph()

    def _check_graph(self) -> None:
        """Refuse a graph of another model: its inputs, cache shapes and vocabulary must match the config."""
        got = {i.name: i for i in self.session.get_inputs()}
        missing = [n for n in self._inputs if n not in got]
        extra = sorted(set(got) - set(self._inputs))
        if missing or extra:
            raise ServingError(f"{self.path}: graph inputs do not match a {self.n_layers}-layer prodip decoder "
                               f"(missing {missing[:4]}, unexpected {extra[:4]})")
        for n, t in _ORT_TYPES.items():
            if got[n].type != t:
                raise ServingError(f"{self.path}: input {n} is {got[n].type}, expected {t}")
        for n in self._inputs[3:]:
            shape = got[n].shape
            if len(shape) != 4 or shape[1] != self.n_kv_heads or shape[3] != self.head_dim:
                raise ServingError(f"{self.path}: {n} has shape {shape}, expected "
                                   f"[batch, {self.n_kv_heads}, past, {self.head_dim}] from onnx_config.json")
        outs = {o.name: o for o in self.session.get_outputs()}
        if [n for n in self._outputs if n not in outs]:
            raise ServingError(f"{self.path}: graph outputs are not logits + present.N.key/value for "
                               f"{self.n_layers} layers")
        v = outs["logits"].shape[-1]
        if v != self.vocab_size:
            raise ServingError(f"{self.path}: logits have {v} entries, onnx_config.json says vocab {self.vocab_size}")

    # -- tokenizer ---------------------------------------------------------------------------------
    def tokenize(self, text: str, *, bos: bool = True, allow_special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, bos=bos, allow_special=allow_special)  # normalizes first

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    # -- the graph ---------------------------------------------------------------------------------
    def empty_past(self, batch: int = 1) -> list[np.ndarray]:
        """Past tensors of length 0: the first pass over a prompt."""
        z = np.zeros((batch, self.n_kv_heads, 0, self.head_dim), dtype=np.float32)
        return [z] * (2 * self.n_layers)

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
            past: Sequence[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        """One graph call. Shapes: ids/positions (B, T), mask (B, P+T), past 2*n_layers x (B, kv, P, hd).

        Returns (logits (B, T, V) fp32, presents: 2*n_layers arrays of (B, kv, P+T, hd))."""
        feed = {"input_ids": np.asarray(input_ids, dtype=np.int64),
                "attention_mask": np.asarray(attention_mask, dtype=np.int64),
                "position_ids": np.asarray(position_ids, dtype=np.int64)}
        feed.update(zip(self._inputs[3:], past, strict=True))
        out = self.session.run(self._outputs, feed)
        return out[0], out[1:]

    def _check_ids(self, ids: Sequence[int]) -> np.ndarray:
        if len(ids) == 0:
            raise ServingError("empty input: give at least one token")
        if len(ids) > self.n_ctx:
            raise ServingError(f"input is {len(ids)} tokens, longer than the context ({self.n_ctx})")
        a = np.asarray(ids, dtype=np.int64)[None]
        if int(a.min()) < 0 or int(a.max()) >= self.vocab_size:
            raise ServingError(f"token ids must be in [0, {self.vocab_size})")
        return a

    def _step(self, ids: Sequence[int], start: int,
              past: Sequence[np.ndarray] | None) -> tuple[np.ndarray, list[np.ndarray]]:
        """The decode loop's step: `ids` at positions start..start+T-1 after a cache of length `start`
        (None: empty). Returns ((T, V) logits, the presents)."""
        t = len(ids)
        mask = np.ones((1, start + t), dtype=np.int64)
        pos = np.arange(start, start + t, dtype=np.int64)[None]
        logits, presents = self.run(np.asarray(ids, dtype=np.int64)[None], mask, pos,
                                    self.empty_past() if past is None else past)
        return logits[0], presents

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """(T, V) fp32 next-token logits for every position, the whole sequence in one pass."""
        return self._step(self._check_ids(ids)[0], 0, None)[0]

    def logits_incremental(self, ids: Sequence[int], prefix: int = 0) -> np.ndarray:
        """(T, V) like `logits`, through the KV cache: `prefix` tokens in one pass, then one at a time."""
        return np.concatenate(feed(self._step, self._check_ids(ids)[0], prefix))

    def generate(self, ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        """Stream sampled ids; stops at an end-of-turn id (not yielded), max_new_tokens or the context end.

        Stop strings are text-level and are applied by `serving.chat_session`, as for every backend."""
        self._check_ids(ids)
        yield from generate_ids(self._step, ids, params, n_ctx=self.n_ctx, eos_ids=self.eos_ids)

    def close(self) -> None:
        self.session = None  # type: ignore[assignment]
