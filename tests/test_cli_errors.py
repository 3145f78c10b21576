"""Every `sparserl` command answers a user error in one line, with a non-zero exit code and no
traceback (issue 27), walked systematically per command: missing arguments, the wrong kind of
path, values out of range, unparsable values, a device that is not there.

The commands run in-process (`sparserl_mcore.cli.main`, stdout/stderr captured) on real inputs:
a tiny HF checkpoint, a real run config, real safetensors files, a garbage patch. No case starts a
rank, a server or a warm start: each is refused before that, which is the point. A bug (an
exception no check turned into a message) is one line naming the file with its traceback.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import torch
from e2e_support import REPO, make_assets, write_config
from safetensors.torch import save_file

from sparserl_mcore import cli
from sparserl_mcore.cli import main

NO_CUDA = not torch.cuda.is_available()
SLURM = ["slurm", "--config", str(REPO / "examples" / "qwen2.5-7b-math.yaml"), "--learner-nodes", "2"]
SLURM_OK = [*SLURM, "--rollout-nodes", "2", "--dry-run", "telemetry.dir={tmp}/slurm"]
CONVERT = ["convert", "hf-to-mcore", "--hf-dir", "{hf}", "--out", "{tmp}/mcore"]
DIFF = ["sync", "diff", "--old", "{A}", "--new", "{B}", "--out", "{tmp}/p.patch"]
APPLY = ["sync", "apply", "--base", "{A}", "--out", "{tmp}/C.safetensors", "--patch"]
TINY = ["model", "make-tiny", "--arch", "qwen2", "--out", "{tmp}/tiny"]
SERVE = ["serve", "--hf-dir", "{hf}"]
SGLANG = ["sglang-serve", "--model-path", "{hf}"]
DEMO = ["demo", "--out", "{tmp}/demo"]
TRAIN = ["train", "--config", "{cfg}", "--nproc", "2"]
ARGPARSE = "error: argument "

# (argv, exit code, what the one line must say). Placeholders: {hf} a tiny HF checkpoint, {cfg} a
# run config over it, {file} a plain file, {tmp} a directory, {A} / {B} two safetensors files of
# one shape, {other} one of another shape, {garbage} a file that is not a patch, {bad_yaml}.
CASES: dict[str, list[tuple[list[str], int, str]]] = {
    "train": [
        (["train"], 2, "the following arguments are required: --config"),
        (["train", "--config", "/nonexistent.yaml"], 2, "cannot read config /nonexistent.yaml"),
        (["train", "--config", "{tmp}"], 2, "Is a directory"),
        (["train", "--config", "{bad_yaml}"], 2, r"invalid YAML: .*\(line 2, column 1\)"),
        ([*TRAIN, "train.stepz=1"], 2, "unknown key train.stepz; allowed keys in train"),
        ([*TRAIN, "train.steps"], 2, "expected KEY=VALUE"),
        ([*TRAIN, "train.steps=abc"], 2, "train.steps: expected an integer, got 'abc'"),
        ([*TRAIN, "train.steps=[1"], 2, r"cannot parse '\[1'"),
        ([*TRAIN, "train.steps=99999999999999999999"], 2, "does not fit a 64-bit integer"),
        ([*TRAIN, "train.seed=-1"], 2, r"seed=-1: must be in \[0, 2147483647\]"),
        ([*TRAIN, "train.seed=4294967296"], 2, r"seed=4294967296: must be in \[0, 2147483647\]"),
        ([*TRAIN, "optimizer.lr=nan"], 2, "optimizer.lr: nan is not a setting"),
        ([*TRAIN, "optimizer.lr=inf"], 2, "optimizer.lr: inf is not allowed here"),
        ([*TRAIN, "rollout.request_timeout_s=1e999"], 2, "rollout.request_timeout_s: inf"),
        ([*TRAIN, "parallel.tensor_model_parallel_size=0"], 2, "tensor_model_parallel_size=0"),
        (["train", "--config", "{cfg}", "--nproc", "0"], 2, ARGPARSE + "--nproc: 0: must be >= 1"),
        (["train", "--config", "{cfg}", "--nproc", "two"], 2, ARGPARSE + "--nproc: 'two' is not an integer"),
        (["train", "--config", "{cfg}", "--nproc", "3"], 2, "world size 3 is not divisible"),
        ([*TRAIN, "model.hf_path={file}"], 2, "model.hf_path .*: is a file, not a checkpoint directory"),
        ([*TRAIN, "model.hf_path=/nonexistent"], 2, "model.hf_path /nonexistent: no such directory"),
        ([*TRAIN, "checkpoint.dir={file}/ckpt"], 2, r"checkpoint.dir=.*: .*file is a file, so .* cannot be"),
        (
            [*TRAIN, "checkpoint.dir=/proc/sparserl-ckpt"],
            2,
            "checkpoint.dir=.*: cannot create files in /proc",
        ),
        ([*TRAIN, "telemetry.dir=/proc/sparserl-run"], 2, "telemetry.dir=.*: cannot create files in /proc"),
        ([*TRAIN, "--save-hf", "{file}"], 2, "checkpoint.save_hf=.*: .* exists and is not a directory"),
        (
            [*TRAIN, "rollout.sampling.stop_token_ids=[100000]"],
            2,
            r"\[100000\] are not token ids of the model",
        ),
        ([*TRAIN, "rollout.sampling.max_new_tokens=5000"], 2, "the model's context holds 2048 positions"),
        ([*TRAIN, "data.train_path={file}"], 2, "data: .*file: unsupported dataset format ''"),
        # issue 36: bad rows are refused before launch naming file, line and lengths (either split)
        (
            [*TRAIN, "data.eval_fraction=0", "data.train_path={empty_prompt}"],
            2,
            r"data: .*empty.jsonl:4: the prompt is empty \(0 tokens\)",
        ),
        (
            [*TRAIN, "data.eval_fraction=0", "data.train_path={long_prompt}"],
            2,
            r"data: .*long.jsonl:2: the prompt has 2040 tokens, and with rollout.sampling.max_new_tokens=12 "
            r"it exceeds the model's context of 2048 positions; .* set data.skip_bad_rows=true",
        ),
        (
            [*TRAIN, "data.eval_fraction=0", "data.eval_path={long_prompt}"],
            2,
            r"data: .*long.jsonl:2: the prompt has 2040 tokens",
        ),
        # issue 36: every callback and wait has a bound
        ([*TRAIN, "reward.timeout_s=0"], 2, "reward: timeout_s=0.0: must be > 0"),
        ([*TRAIN, "reward.timeout_s=1e300"], 2, "reward: timeout_s=1e.300: must be <="),
        ([*TRAIN, "train.max_empty_steps=-1"], 2, "max_empty_steps=-1: must be >= 0"),
        (
            [*TRAIN, "train.async.mode=in_flight", "train.async.max_staleness=1000000"],
            2,
            "max_staleness=1000000: must be <= 8",
        ),
        ([*TRAIN, "rollout.sampling.temperature=1e-300"], 2, "temperature=1e-300: below 1e-06"),
        ([*TRAIN, "eval.temperature=1e-300"], 2, "eval: temperature=1e-300: below 1e-06"),
    ],
    "demo": [
        ([*DEMO, "train.stepz=1"], 2, "unknown key train.stepz"),
        ([*DEMO, "--nproc", "0"], 2, ARGPARSE + "--nproc: 0: must be >= 1"),
        ([*DEMO, "--nproc", "3"], 2, "tensor_model_parallel_size=3 does not divide num_attention_heads=4"),
        ([*DEMO, "--nproc", "4"], 2, "tensor_model_parallel_size=4 does not divide num_key_value_heads=2"),
        ([*DEMO, "--steps", "0"], 2, ARGPARSE + "--steps: 0: must be >= 1"),
        ([*DEMO, "--seed", "-1"], 2, r"train: seed=-1: must be in \[0, 2147483647\]"),
        ([*DEMO, "--seed", "x"], 2, ARGPARSE + "--seed: invalid int value"),
        (["demo", "--out", "{file}"], 2, "--out .*file exists and is not a directory"),
        (["demo", "--out", "/proc/sparserl-demo"], 2, "--out cannot create files in /proc"),
        ([*DEMO, "reward.name=nope"], 2, "unknown reward 'nope'"),
        ([*DEMO, "optimizer.lr=-1"], 2, r"optimizer: lr=-1.0: must be > 0"),
    ],
    "convert": [
        (["convert"], 2, "the following arguments are required: ACTION"),
        (["convert", "hf-to-mcore"], 2, "the following arguments are required: --hf-dir, --out"),
        (["convert", "to-gguf"], 2, "invalid choice: 'to-gguf'"),
        ([*CONVERT, "--tp", "0"], 2, ARGPARSE + "--tp: 0: must be >= 1"),
        ([*CONVERT, "--pp", "-1"], 2, ARGPARSE + "--pp: -1: must be >= 1"),
        ([*CONVERT, "--tp", "x"], 2, ARGPARSE + "--tp: 'x' is not an integer"),
        ([*CONVERT, "--tp", "3"], 2, "tensor_model_parallel_size=3 does not divide num_attention_heads=4"),
        ([*CONVERT, "--dtype", "float16"], 2, "--dtype 'float16'; choose float32 or bfloat16"),
        ([*CONVERT, "--timeout", "-1"], 2, ARGPARSE + "--timeout: -1: must be > 0"),
        ([*CONVERT, "--timeout", "nan"], 2, ARGPARSE + "--timeout: nan: give a finite number"),
        (["convert", "hf-to-mcore", "--hf-dir", "/nonexistent", "--out", "{tmp}/o"], 2, "no such directory"),
        (
            ["convert", "hf-to-mcore", "--hf-dir", "{file}", "--out", "{tmp}/o"],
            2,
            "is a file, not a checkpoint",
        ),
        (
            ["convert", "hf-to-mcore", "--hf-dir", "{hf}", "--out", "{file}"],
            2,
            "exists and is not a directory",
        ),
        (["convert", "hf-to-mcore", "--hf-dir", "{hf}", "--out", "{file}/x"], 2, "file is a file, so"),
        (
            ["convert", "hf-to-mcore", "--hf-dir", "{hf}", "--out", "/proc/x"],
            2,
            "cannot create files in /proc",
        ),
        (
            ["convert", "mcore-to-hf", "--mcore-dir", "{hf}", "--out", "{tmp}/o"],
            2,
            "not a checkpoint written by",
        ),
        (
            ["convert", "mcore-to-hf", "--mcore-dir", "/nonexistent", "--out", "{tmp}/o"],
            2,
            "not a checkpoint",
        ),
        (
            [
                "convert",
                "mcore-to-hf",
                "--mcore-dir",
                "{hf}",
                "--out",
                "{tmp}/o",
                "--max-shard-size",
                "2 gigs",
            ],
            2,
            "--max-shard-size: '2 gigs': use a size like 2GB",
        ),
        (["convert", "verify"], 2, "the following arguments are required: --hf-dir, --mcore-dir"),
        (["convert", "verify", "--hf-dir", "/nonexistent", "--mcore-dir", "{hf}"], 2, "no such directory"),
        (
            ["convert", "verify", "--hf-dir", "{hf}", "--mcore-dir", "{file}"],
            2,
            "--mcore-dir .*: no such directory",
        ),
        (
            ["convert", "verify", "--hf-dir", "{hf}", "--mcore-dir", "{hf}", "--tp", "0"],
            2,
            "--tp: 0: must be",
        ),
        (["convert", "verify", "--hf-dir", "{hf}", "--mcore-dir", "{hf}", "--tolerance", "nan"], 2, "finite"),
    ],
    "sync": [
        (["sync"], 2, "the following arguments are required: ACTION"),
        (["sync", "diff", "--old", "{A}"], 2, "the following arguments are required: --new, --out"),
        (
            ["sync", "diff", "--old", "{A}", "--new", "/nonexistent", "--out", "{tmp}/p"],
            1,
            "neither a safetensors",
        ),
        (
            ["sync", "diff", "--old", "{file}", "--new", "{B}", "--out", "{tmp}/p"],
            1,
            "not a readable safetensors",
        ),
        (
            ["sync", "diff", "--old", "{A}", "--new", "{other}", "--out", "{tmp}/p"],
            1,
            "differ in tensor names",
        ),
        (
            ["sync", "diff", "--old", "{A}", "--new", "{B}", "--out", "{file}/p"],
            1,
            "--out .*file is a file, so",
        ),
        (
            ["sync", "diff", "--old", "{A}", "--new", "{B}", "--out", "/proc/p"],
            1,
            "cannot create files in /proc",
        ),
        (
            ["sync", "diff", "--old", "{A}", "--new", "{B}", "--out", "{tmp}"],
            1,
            "is a directory; give a file",
        ),
        ([*DIFF, "--version", "0"], 2, ARGPARSE + "--version: 0: must be >= 1"),
        ([*DIFF, "--base-version", "-1"], 2, ARGPARSE + "--base-version: -1: must be >= 0"),
        ([*DIFF, "--zstd-level", "99"], 1, "zstd_level=99 is out of range"),
        ([*DIFF, "--encoding", "nope"], 1, "encoding='nope' is unknown"),
        ([*APPLY, "{garbage}"], 1, "patch is truncated"),
        ([*APPLY, "/nonexistent"], 1, "/nonexistent: No such file or directory"),
        ([*APPLY, "{tmp}"], 1, "Is a directory"),
        (
            ["sync", "apply", "--base", "{A}", "--patch", "{garbage}", "--out", "{file}/C"],
            1,
            "file is a file",
        ),
        (["sync", "inspect", "{garbage}"], 1, "patch is truncated"),
        (["sync", "inspect", "{tmp}"], 1, "Is a directory"),
        (["sync", "inspect", "/nonexistent"], 1, "No such file or directory"),
        (["sync", "bench", "--steps", "0"], 2, ARGPARSE + "--steps: 0: must be >= 1"),
        (["sync", "bench", "--lrs", "nan"], 2, ARGPARSE + "--lrs: nan: give a finite number"),
        (["sync", "bench", "--seq-len", "-3"], 2, ARGPARSE + "--seq-len: -3: must be >= 1"),
        (["sync", "bench", "--hf-dir", "/nonexistent"], 1, "--hf-dir /nonexistent: no such directory"),
        (["sync", "bench", "--json", "{tmp}"], 1, "is a directory; give a file path"),
    ],
    "model": [
        (["model"], 2, "the following arguments are required: ACTION"),
        (["model", "make-tiny"], 2, "the following arguments are required: --arch, --out"),
        ([*TINY[:-2], "--out", "{tmp}/t", "--arch", "gpt9"], 2, "arch='gpt9' is not supported"),
        ([*TINY, "--layers", "0"], 2, ARGPARSE + "--layers: 0: must be >= 1"),
        ([*TINY, "--head-dim", "0"], 2, ARGPARSE + "--head-dim: 0: must be >= 1"),
        ([*TINY, "--hidden", "big"], 2, ARGPARSE + "--hidden: 'big' is not an integer"),
        ([*TINY, "--heads", "3"], 2, "heads=3 must be a multiple of kv_heads=2"),
        ([*TINY, "--vocab", "10"], 2, "vocab=10 is smaller than the tokenizer"),
        ([*TINY, "--dtype", "int8"], 2, "dtype='int8'; choose from"),
        ([*TINY, "--max-shard-size", "huge"], 2, ARGPARSE + "--max-shard-size: 'huge': use a size like 2GB"),
        ([*TINY, "--seed", "-1"], 2, ARGPARSE + "--seed: -1: must be >= 0"),
        (["model", "make-tiny", "--arch", "qwen2", "--out", "{file}"], 2, "exists and is not a directory"),
        (["model", "make-tiny", "--arch", "qwen2", "--out", "{file}/x"], 2, "file is a file, so"),
        (["model", "make-tiny", "--arch", "qwen2", "--out", "/proc/x"], 2, "cannot create files in /proc"),
    ],
    "serve": [
        (["serve"], 2, "the following arguments are required: --hf-dir"),
        (["serve", "--hf-dir", "/nonexistent"], 2, "--hf-dir /nonexistent: no such directory"),
        (["serve", "--hf-dir", "{file}"], 2, "is a file, not a checkpoint directory"),
        ([*SERVE, "--port", "70000"], 2, r"port=70000: must be in \[0, 65535\]"),
        ([*SERVE, "--port", "http"], 2, ARGPARSE + "--port: invalid int value"),
        ([*SERVE, "--token", "short"], 2, "token is shorter than 8 characters"),
        ([*SERVE, "--host", "0.0.0.0"], 2, "reachable from the network but no token is set"),
        ([*SERVE, "--device", "tpu"], 2, "device='tpu': choose 'auto', 'cpu', 'cuda' or 'cuda:N'"),
        ([*SERVE, "--device", "cuda:64"], 2, r"device='cuda:64': (no CUDA device here|\d+ CUDA device)"),
        ([*SERVE, "--dtype", "int8"], 2, "dtype='int8': choose 'auto' or one of"),
        ([*SERVE, "--kv-method", "nope"], 2, "method='nope': unknown KV compression"),
        (
            [*SERVE, "--kv-method", "snapkv", "--kv-budget", "8", "--kv-interval", "2"],
            2,
            "nothing left to select",
        ),
        ([*SERVE, "--kv-budget", "x"], 2, ARGPARSE + "--kv-budget: invalid int value"),
        ([*SERVE, "--page-size", "0"], 2, "page_size=0: must be >= 1"),
        ([*SERVE, "--capacity-pages", "0"], 2, "capacity_pages=0: must be >= 1"),
        ([*SERVE, "--capacity-pages", "9", "--capacity-bytes", "9"], 2, "both set: set at most one"),
        ([*SERVE, "--max-new-tokens", "0"], 2, "max_new_tokens=0: must be >= 1"),
        ([*SERVE, "--max-batch-requests", "0"], 2, "max_batch_requests=0: must be >= 1"),
        ([*SERVE, "--request-timeout", "-1"], 2, ARGPARSE + "--request-timeout: -1: must be >= 0"),
        ([*SERVE, "--request-timeout", "nan"], 2, ARGPARSE + "--request-timeout: nan: give a finite number"),
        ([*SERVE, "--client-timeout", "0"], 2, ARGPARSE + "--client-timeout: 0: must be > 0"),
        ([*SERVE, "--keep-alive-timeout", "inf"], 2, ARGPARSE + "--keep-alive-timeout: inf: give a finite"),
        ([*SERVE, "--seed", "-1"], 2, r"seed=-1: must be in \[0, 2\*\*63\)"),
        ([*SERVE, "--log-level", "loud"], 2, ARGPARSE + "--log-level: invalid choice: 'loud'"),
    ],
    "slurm": [
        (["slurm"], 2, "the following arguments are required: --config, --learner-nodes"),
        ([*SLURM_OK[:3], "--learner-nodes", "0"], 2, ARGPARSE + "--learner-nodes: 0: must be >= 1"),
        ([*SLURM_OK, "--rollout-nodes", "-1"], 2, ARGPARSE + "--rollout-nodes: -1: must be >= 0"),
        ([*SLURM_OK, "--gpus-per-node", "-1"], 2, ARGPARSE + "--gpus-per-node: -1: must be >= 0"),
        (
            [*SLURM_OK, "--gpus-per-node", "0", "--ranks-per-node", "0"],
            2,
            "--ranks-per-node: 0: must be >= 1",
        ),
        ([*SLURM_OK, "--time", "soon"], 2, "--time 'soon': use a Slurm time"),
        ([*SLURM_OK, "--stop-before", "-1"], 2, ARGPARSE + "--stop-before: -1: must be >= 1"),
        ([*SLURM_OK, "--stop-before", "90000"], 2, "--stop-before 90000 s must be > 0 and shorter than"),
        ([*SLURM_OK, "--rollout-port", "70000"], 2, "--rollout-port 70000: the job uses ports 69998..70007"),
        ([*SLURM_OK, "--rollout-port", "2"], 2, "--rollout-port 2: the job uses ports 0..9"),
        ([*SLURM_OK, "--job-name", "a b"], 2, "--job-name 'a b': use letters, digits"),
        ([*SLURM_OK, "--rollout-server", "vllm"], 2, ARGPARSE + "--rollout-server: invalid choice"),
        ([*SLURM_OK, "--out", "{tmp}"], 2, "--out: .* is a directory; give a file path"),
        ([*SLURM_OK, "--out", "{file}/job.sbatch"], 2, "--out: .*file is a file, so"),
        ([*SLURM_OK, "telemetry.dir=/proc/sparserl-job"], 2, "telemetry.dir: cannot create files in /proc"),
        ([*SLURM_OK, "train.seed=-5"], 2, r"seed=-5: must be in \[0, 2147483647\]"),
        (["slurm", "--config", "/nonexistent.yaml", "--learner-nodes", "1"], 2, "cannot read config"),
    ],
    "sglang-serve": [
        (["sglang-serve"], 2, "the following arguments are required: --model-path"),
        ([*SGLANG, "--port", "0"], 2, ARGPARSE + r"--port: 0: must be a TCP port \(1..65535\)"),
        ([*SGLANG, "--port", "70000"], 2, ARGPARSE + "--port: 70000: must be a TCP port"),
        ([*SGLANG, "--tp-size", "0"], 2, ARGPARSE + "--tp-size: 0: must be >= 1"),
        ([*SGLANG, "--max-running-requests", "0"], 2, ARGPARSE + "--max-running-requests: 0: must be >= 1"),
        ([*SGLANG, "--startup-timeout", "-1"], 2, ARGPARSE + "--startup-timeout: -1: must be > 0"),
        ([*SGLANG, "--startup-timeout", "nan"], 2, ARGPARSE + "--startup-timeout: nan: give a finite number"),
        ([*SGLANG, "--kv-method", "h2o"], 2, "kv method 'h2o' does not work inside SGLang"),
        ([*SGLANG, "--kv-method", "nope"], 2, "method='nope': unknown KV compression"),
        ([*SGLANG, "--host", "0.0.0.0"], 2, "reachable from the network but no token is set"),
        ([*SGLANG, "--token", "short"], 2, "token is shorter than 8 characters"),
    ],
}
if NO_CUDA:  # a machine without a GPU: the device itself is the user's error
    CASES["sglang-serve"].append(
        (SGLANG, 2, "(no CUDA device here: SGLang serves on GPUs|SGLang is not installed)")
    )
    CASES["serve"].append(([*SERVE, "--device", "cuda"], 2, "device='cuda': no CUDA device here"))

PARAMS = [
    pytest.param(command, argv, code, said, id=f"{command}:{' '.join(argv[1:])[-60:]}")
    for command, cases in CASES.items()
    for argv, code, said in cases
]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cli")
    hf = make_assets(root)
    cfg = write_config(root, hf, "cli")
    (root / "file").write_text("not what any command wants\n")
    (root / "bad.yaml").write_text("model: [\n")
    (root / "garbage.patch").write_bytes(b"garbage")
    rows = ['{"prompt": "say 1:", "answer": "a"}', "", '{"prompt": "say 2:", "answer": "a"}']
    (root / "empty.jsonl").write_text("\n".join([*rows, '{"prompt": "", "answer": "a"}']) + "\n")
    long = json.dumps({"prompt": "x" * 2040, "answer": "a"})  # the tiny tokenizer: a token a character
    (root / "long.jsonl").write_text("\n".join([rows[0], long, *rows[2:]]) + "\n")
    weights = {"w": torch.zeros(4, 4, dtype=torch.bfloat16), "b": torch.ones(4, dtype=torch.bfloat16)}
    save_file(weights, root / "A.safetensors")
    save_file({k: v + 1 for k, v in weights.items()}, root / "B.safetensors")
    save_file({"other": torch.zeros(2, dtype=torch.bfloat16)}, root / "other.safetensors")
    return {
        "hf": str(hf),
        "cfg": str(cfg),
        "file": str(root / "file"),
        "tmp": str(root),
        "A": str(root / "A.safetensors"),
        "B": str(root / "B.safetensors"),
        "other": str(root / "other.safetensors"),
        "garbage": str(root / "garbage.patch"),
        "bad_yaml": str(root / "bad.yaml"),
        "empty_prompt": str(root / "empty.jsonl"),
        "long_prompt": str(root / "long.jsonl"),
    }


def _one_line(capsys) -> str:
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.err, out.err
    return lines[0]


@pytest.mark.parametrize(("command", "argv", "code", "said"), PARAMS)
def test_a_user_error_is_one_line_and_a_non_zero_exit(paths, capsys, command, argv, code, said):
    argv = [a.format(**paths) for a in argv]
    before = set(pathlib.Path(paths["tmp"]).iterdir())
    assert main(argv) == code
    line = _one_line(capsys)
    assert re.match(rf"sparserl {command}( [a-z-]+)?: ", line), line  # the command (and action)
    assert re.search(said.format(**paths), line), line
    assert set(pathlib.Path(paths["tmp"]).iterdir()) == before  # refused before writing anything


def test_the_walk_covers_every_command():
    assert set(CASES) == set(cli.COMMANDS)


def test_an_unknown_command_and_help_are_not_errors(capsys):
    assert main(["trian"]) == 2
    assert "unknown command 'trian'; choose from model, convert" in _one_line(capsys)
    assert main(["convert", "hf-to-mcore", "--help"]) == 0
    assert "--hf-dir" in capsys.readouterr().out


class _Broken:
    """A command with a bug (the injected fault): its run raises."""

    @staticmethod
    def add_arguments(parser) -> None:
        parser.add_argument("--path", default=None)

    @staticmethod
    def run(args) -> int:
        if args.path:
            raise PermissionError(13, "Permission denied", args.path)
        return {}["missing"]  # KeyError: a bug


def test_a_bug_is_one_line_naming_its_traceback_and_a_refused_file_is_one_line(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(cli.COMMANDS, "broken", ("tests.broken", "a command with a bug"))
    monkeypatch.setitem(sys.modules, "tests.broken", _Broken)
    assert main(["broken"]) == 1
    line = _one_line(capsys)
    assert line.startswith("sparserl broken: internal error (KeyError: 'missing'); this is a bug")
    log = pathlib.Path(line.rsplit(" ", 1)[1])
    text = log.read_text()
    assert "Traceback" in text and 'return {}["missing"]' in text
    log.unlink()
    assert main(["broken", "--path", "/etc/secret"]) == 1
    assert _one_line(capsys) == "sparserl broken: /etc/secret: Permission denied"
