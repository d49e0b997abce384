"""The benchmarks' torch-transport method: hvdlite under torchrun beside MPI. What is
launched, and the ratios printed; no benchmark runs here (tests/integration/
test_bench_transports.py runs them)."""
from __future__ import annotations

import sys

import pytest

from bench import allreduce_transports, launches, training


def test_a_torchrun_method_is_launched_by_torch_distributed_run_on_this_host() -> None:
    method = launches.Method("hvdlite_gloo", ("training-worker", "--model", "mlp"),
                             launcher="torchrun")
    command = launches.command_for(method, 3)
    assert command[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=3"]
    assert not any(a.startswith("--master_port") for a in command)   # picked, then raced
    assert command[-5:] == ["-m", "bench", "training-worker", "--model", "mlp"]


def test_an_mpi_method_is_launched_by_the_venvs_mpiexec() -> None:
    command = launches.command_for(launches.Method("hvdlite", ("x",)), 2)
    assert command[:3] == [launches.mpiexec_path(), "-n", "2"] and command[-1] == "x"
    with pytest.raises(ValueError, match="unknown launcher"):
        launches.command_for(launches.Method("odd", (), launcher="srun"), 2)


def test_training_launches_hvdlite_gloo_under_torchrun_and_the_rest_under_mpiexec() -> None:
    methods = training._methods("transformer", 0.5, None,
                                ["hvdlite", "hvdlite_gloo", "ddp_gloo"])
    launchers = {m.label: m.launcher for m in methods}
    assert launchers == {"hvdlite": "mpiexec", "hvdlite_gloo": "torchrun",
                         "ddp_gloo": "mpiexec"}
    gloo = next(m for m in methods if m.label == "hvdlite_gloo")
    assert gloo.args[:3] == ("training-worker", "--method", "hvdlite") and gloo.env == ()


def test_training_prints_the_gloo_transport_against_mpi_and_ddp(
        capsys: pytest.CaptureFixture) -> None:
    rows = [("transformer", 2, {"hvdlite": launches.Samples([100.0, 100.0]),
                                "hvdlite_gloo": launches.Samples([90.0, 95.0]),
                                "ddp_gloo": launches.Samples([80.0, 100.0])})]
    training._print_table(rows, 2)
    out = capsys.readouterr().out
    assert "gloo-transport/MPI: 0.93x (0.90-0.95)" in out
    assert "gloo-transport/DDP: 1.03x (0.95-1.12)" in out
    assert "hvdlite_gloo:" in out.split("Peak RSS")[1]


def test_allreduce_launches_each_transport_with_its_launcher() -> None:
    args = allreduce_transports._options(__import__("argparse").ArgumentParser()).parse_args(
        ["--max-mib", "8", "--seconds", "0.1", "--lone-repeats", "7"])
    methods = allreduce_transports._methods(["mpi", "torch"], args)
    assert [(m.label, m.launcher) for m in methods] == [("mpi", "mpiexec"),
                                                        ("torch", "torchrun")]
    assert methods[1].args == ("allreduce-worker", "--max-mib", "8", "--seconds", "0.1",
                               "--lone-repeats", "7")


def test_allreduce_table_has_every_figure_with_the_gloo_transports_ratios(
        capsys: pytest.CaptureFixture) -> None:
    def launched(lone: list[float], big: list[float], small: list[float]) -> launches.Samples:
        raw = {"raw_lone": [x * 2 for x in lone], "raw_big": [x * 2 for x in big],
               "raw_small": [x * 2 for x in small]}
        return launches.Samples(lone, {"big": big, "small": small, **raw})
    samples = {"mpi": launched([50.0, 50.0], [4e4, 4e4], [2e3, 2e3]),
               "torch": launched([100.0, 100.0], [4e4, 4e4], [1e3, 1e3])}
    allreduce_transports.print_table(samples, 2, 2, 64)
    lines = capsys.readouterr().out.splitlines()
    lone = next(l for l in lines if "lone 4-byte op" in l)
    assert "50.0 us" in lone and "100.0 us" in lone and "0.50x (0.50-0.50)" in lone
    assert lone.endswith("2.00x (2.00-2.00)")          # raw gloo takes twice as long
    big = next(l for l in lines if "64 MiB" in l)
    assert "40.0 ms" in big and "1.00x" in big
    small = next(l for l in lines if "200 x 4 KiB" in l)
    assert "2.00x (2.00-2.00)" in small


def test_allreduce_table_with_one_transport_prints_no_ratio_against_the_other(
        capsys: pytest.CaptureFixture) -> None:
    allreduce_transports.print_table({"mpi": launches.Samples([50.0])}, 1, 1, 64)
    out = capsys.readouterr().out
    assert "hvdlite torch" not in out and "mpi4py" in out
