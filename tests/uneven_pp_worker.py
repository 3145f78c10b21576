"""Multi-rank half of tests/test_uneven_pipeline.py, run once under torchrun with 3 ranks (PP=3).

    uneven_pp_worker.py WORK HF_DIR...

For 5-layer checkpoints (stages of 2, 2 and 1 layers): HF transformers logit parity after loading
the HF weights (parity_worker), HF -> dist checkpoint -> HF at PP=3 (ckpt_worker), and the
`sparserl convert verify` rank entry on that dist checkpoint at PP=3.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import ckpt_worker
import parity_worker


def main(work: pathlib.Path, hf_dirs: list[str]) -> int:
    from sparserl_mcore.launch import verify

    found = {"parity": parity_worker.run_layout(1, 3, "float32", hf_dirs), "verify": {}}
    for hf in hf_dirs:
        name = pathlib.Path(hf).name
        mcore, out = work / f"{name}_mcore", work / f"{name}_out"
        ckpt_worker.roundtrip(
            {"hf": hf, "mcore": str(mcore), "out": str(out), "save_at": (1, 3), "export_at": (1, 3)}
        )
        result = work / f"{name}_verify.json"
        verify.main(["--hf-dir", hf, "--mcore-dir", str(mcore), "--pp", "3", "--result", str(result)])
        if result.is_file():
            found["verify"][name] = json.loads(result.read_text())
    (work / f"rank{os.environ['RANK']}.json").write_text(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main(pathlib.Path(sys.argv[1]), sys.argv[2:]))
