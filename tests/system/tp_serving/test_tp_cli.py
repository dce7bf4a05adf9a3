"""``serve``'s tensor-parallel flags: refusals are one line before any rank starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from executor.distributed.spawn import ParallelConfig, rank_device
from executor.errors import ConfigError
from service.cli import build_parser, parallel_configs
from tests.helpers.serving import ROOT


def _args(*extra: str) -> object:
    return build_parser().parse_args(["serve", *extra])


def test_size_comes_from_the_flag_or_the_launcher() -> None:
    parallel, rdv = parallel_configs(_args(), {})
    assert parallel.tensor_parallel_size == 1 and rdv is None
    parallel, rdv = parallel_configs(_args("--tensor-parallel-size", "4"), {})
    assert parallel.tensor_parallel_size == 4 and rdv is None
    env = {"MASTER_ADDR": "h", "MASTER_PORT": "1", "WORLD_SIZE": "8", "RANK": "3",
           "LOCAL_RANK": "3"}
    parallel, rdv = parallel_configs(_args(), env)
    assert parallel.tensor_parallel_size == 8 and rdv is not None and rdv.rank == 3
    with pytest.raises(ConfigError, match="WORLD_SIZE=8"):
        parallel_configs(_args("--tensor-parallel-size", "2"), env)
    with pytest.raises(ConfigError):
        parallel_configs(_args("--tensor-parallel-size", "0"), {})


def test_all_reduce_algorithm_flag() -> None:
    parallel, _ = parallel_configs(_args(), {})
    assert parallel.all_reduce == "auto"
    parallel, _ = parallel_configs(_args("--tp-all-reduce", "nccl"), {})
    assert parallel.all_reduce == "nccl"
    parallel, _ = parallel_configs(_args("--tp-all-reduce", "symm_mem"), {})
    assert parallel.all_reduce == "symm_mem"
    for algo in ("flags", "push"):
        parallel, _ = parallel_configs(_args("--tp-all-reduce", algo), {})
        assert parallel.all_reduce == algo
    for old in ("triton", "lamport"):  # the algorithms' former names
        with pytest.raises(SystemExit):
            _args("--tp-all-reduce", old)
    with pytest.raises(SystemExit):  # argparse: one line naming the choices
        _args("--tp-all-reduce", "ring")
    with pytest.raises(ConfigError, match="auto, nccl, symm_mem, flags, push"):
        ParallelConfig(2, all_reduce="ring")  # type: ignore[arg-type]


def test_projections_send_into_the_all_reduce_unless_told_otherwise() -> None:
    """``--tp-gemm-send``: on by default, off when asked; anything else refused by
    argparse, and a non-bool by the config itself when built in code. The fused mode's
    former flag is gone."""
    parallel, _ = parallel_configs(_args(), {})
    assert parallel.gemm_send is True
    for mode, want in (("on", True), ("off", False)):
        parallel, _ = parallel_configs(_args("--tp-gemm-send", mode), {})
        assert parallel.gemm_send is want
    with pytest.raises(SystemExit):
        _args("--tp-gemm-send", "send")
    with pytest.raises(SystemExit):
        _args("--tp-fuse-all-reduce", "off")
    with pytest.raises(ConfigError, match="on, off"):
        ParallelConfig(2, gemm_send="on")  # type: ignore[arg-type]


def test_each_rank_gets_its_own_gpu() -> None:
    assert rank_device("cuda", 3) == "cuda:3" and rank_device("cpu", 3) == "cpu"
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES"):
        rank_device("cuda:1", 0)


def test_a_size_the_heads_do_not_divide_is_refused_before_any_rank_starts() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--device", "cpu", "--port", "0",
         "--metrics-port", "-1", "--tensor-parallel-size", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(ROOT)})
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == ("model-executor: error: --tensor-parallel-size 3 does not divide the "
                         "model's 4 query heads, 2 KV heads and MLP width 256 (KV heads are "
                         "not replicated); sizes that work: 1, 2"), done.stderr
    assert "ranks_spawned" not in done.stdout + done.stderr


def test_more_ranks_than_visible_gpus_is_refused_before_any_rank_starts(
        capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from executor.config import ExecutorConfig
    from executor.distributed.spawn import ParallelConfig
    from service.config import ServerConfig
    from service.parallel import run

    size = max(2, torch.cuda.device_count() + 1)
    config = ExecutorConfig(device="cuda")
    assert run(config, ServerConfig(port=0, metrics_port=None), ParallelConfig(size)) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"model-executor: error: --tensor-parallel-size {size} needs {size} GPUs "
                   f"on this host (one per rank); {torch.cuda.device_count()} are visible")
