"""HFInit: `--init-from` a Hugging Face Llama folder, as one component of the Trainer.

`open()` (while the data is read) checks the folder against the data's tokenizer and gives the model
shape; `load()` (a fresh run only) copies the weights into the model on the CPU before wrapping and runs
the import parity gate on the data's first ids, which stay unconsumed. Its gate result joins the
pre-flight report in gates.json (`gates`). The import itself lives in training.model.hf_import.
"""

from __future__ import annotations

from collections.abc import Callable

from training.data.loaders import TrainingData
from training.model import hf_import
from training.model.decoder import ModelConfig, Transformer
from training.runfiles.gate_results import GateResult
from training.text.tokenizer import Tokenizer


class HFInit:
    def __init__(self, spec: str, say: Callable[[str], None]):
        self.spec, self.say = spec, say
        self.imported: hf_import.Imported | None = None
        self.gates: list[GateResult] = []  # the parity gate, once load() ran (a resumed run has none)

    def open(self, tokenizer: Tokenizer, data: str) -> ModelConfig:
        """The folder checked (architecture, config fields, weights, tokenizer = the data's): its shape."""
        self.imported = hf_import.open_folder(self.spec, tokenizer, data)
        return self.imported.model_cfg

    def load(self, model: Transformer, data: TrainingData) -> None:
        """The HF weights into `model` and the parity gate; what normalization and fertility say, printed."""
        imp, loader = self.imported, data.train
        state = loader.state_dict()
        ids = loader.next_batch(1)[0][:, :hf_import.PARITY_TOKENS]
        loader.load_state_dict(state)  # the parity ids are not consumed
        self.say(hf_import.normalization_note(imp.base_proto))
        self.say(hf_import.fertility_note(imp.tokenizer, data.data_report))
        self.gates = hf_import.import_weights(model, imp, ids)
        g = self.gates[0]
        self.say(f"initialized from {imp.folder} ({hf_import.ARCHITECTURE}); {g.name}: max |logit "
                 f"difference| {g.value:.3g} vs transformers (<= {hf_import.PARITY_TOL:g})")
