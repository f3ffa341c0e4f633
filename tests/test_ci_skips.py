"""No silent tiers (issue #32): under CI=true a skip fails unless its test is on tests/skips_allowed.txt
with an "opt-in:" reason. The allow-list names real tests, each with its reason, and none of the tiers
that scripts/test.sh installs or builds (llama.cpp tools, foreign GGUFs, ONNX Runtime GenAI, openai)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
from conftest import ALLOWED_SKIPS_FILE, OPT_IN, REPO, allowed_skips, skip_allowed_in_ci

PROBE_ENV = "PRODIP_SKIP_PROBE"  # set only by test_an_unlisted_skip_fails_a_ci_run, in its child pytest
MUST_RUN = ("tests/test_llama_tools.py::", "tests/test_imatrix.py::", "tests/test_genai.py::",
            "tests/test_any_gguf.py::", "tests/test_export_hf.py::")

if os.environ.get(PROBE_ENV):
    def test_probe_skip():
        pytest.skip(os.environ[PROBE_ENV])


def test_every_allowed_pattern_names_a_real_test_and_says_why():
    allowed = allowed_skips()
    assert allowed, f"{ALLOWED_SKIPS_FILE} lists nothing"
    for pattern, why in allowed.items():
        path, _, name = pattern.partition("::")
        assert why and (REPO / path).is_file(), pattern
        tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
        func = name.split("[", 1)[0]
        tests = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
        assert any(t == func or (func.endswith("*") and t.startswith(func[:-1])) for t in tests), pattern


def test_a_reason_is_required(tmp_path):
    f = tmp_path / "skips.txt"
    f.write_text("tests/test_x.py::test_y\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no reason"):
        allowed_skips(f)


def test_only_listed_opt_in_skips_pass():
    allowed = allowed_skips()
    listed = "tests/test_parity.py::test_backend_tokenizers_match_training_on_tatoeba"
    assert skip_allowed_in_ci(listed, f"{OPT_IN} breadth test on ../shared/data", allowed)
    assert not skip_allowed_in_ci(listed, "something is missing", allowed)  # listed, but not an opt-in reason
    assert skip_allowed_in_ci("tests/test_tokenizer.py::test_decode_encode_roundtrip_every_line[tatoeba]",
                              f"{OPT_IN} x", allowed)
    assert not skip_allowed_in_ci("tests/test_tokenizer.py::test_decode_encode_roundtrip_every_line[shipped]",
                                  f"{OPT_IN} x", allowed)
    for prefix in MUST_RUN:  # the tiers CI installs: never on the list, whatever their reason says
        assert not skip_allowed_in_ci(prefix + "test_anything", f"{OPT_IN} tools not built", allowed), prefix


def test_an_unlisted_skip_fails_a_ci_run():
    """The hook itself, in a real pytest run: an "opt-in:" skip of a test not on the list is a failure."""
    env = {**os.environ, "CI": "true", PROBE_ENV: f"{OPT_IN} probe"}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/test_ci_skips.py::test_probe_skip"], capture_output=True, text=True, cwd=REPO, env=env,
                       timeout=300)
    assert p.returncode == 1 and "1 failed" in p.stdout and "CI=true forbids this skip" in p.stdout, p.stdout[-2000:]
