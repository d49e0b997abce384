"""The sweep of what aborted MPI jobs leave (hvdlite/runner/leftovers.py), on a fake /dev/shm and
/proc under tmp_path; tests/integration/test_leftovers.py runs it after a real job."""
from __future__ import annotations

from pathlib import Path

from hvdlite.runner import leftovers


def _places(tmp_path: Path) -> dict[Path, tuple[str, ...]]:
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    return {shm: ("mpich_shm_*", "sm_segment.*"), tmp: ("hydra_hwloc_xmlfile_*",)}


def _process(proc: Path, pid: int, *paths: Path) -> None:
    """A fake /proc/PID/maps that maps ``paths`` (and an anonymous region)."""
    (proc / str(pid)).mkdir(parents=True)
    lines = ["7f0000000000-7f0000001000 rw-p 00000000 00:00 0 "]
    lines += [f"7f{i:010x}-7f{i + 1:010x} rw-s 00000000 00:1a {i} {p}"
              for i, p in enumerate(paths)]
    (proc / str(pid) / "maps").write_text("\n".join(lines) + "\n")


def test_the_files_a_session_left_are_removed_and_the_older_ones_kept(tmp_path: Path) -> None:
    places = _places(tmp_path)
    shm, tmp = list(places)
    older = shm / "mpich_shm_aaaa_0"
    older.write_bytes(b"x")
    before = leftovers.present(places)
    left = [shm / "mpich_shm_bbbb_0", shm / "sm_segment.vm.0.1230000.0",
            tmp / "hydra_hwloc_xmlfile_Q1w2e3"]
    for path in left:
        path.write_bytes(b"x")
    (shm / "torch_12_345").write_bytes(b"x")          # not an MPI's: never touched
    gone = leftovers.sweep(before, places, tmp_path / "proc")
    assert gone == sorted(left)
    assert sorted(p.name for p in shm.iterdir()) == ["mpich_shm_aaaa_0", "torch_12_345"]
    assert not any(tmp.iterdir())


def test_a_segment_a_live_process_maps_is_a_running_jobs_and_is_kept(tmp_path: Path) -> None:
    places = _places(tmp_path)
    shm = next(iter(places))
    before = leftovers.present(places)
    running, dead = shm / "mpich_shm_run_0", shm / "mpich_shm_dead_0"
    running.write_bytes(b"x")
    dead.write_bytes(b"x")
    proc = tmp_path / "proc"
    _process(proc, 4321, running)
    _process(proc, 4322, Path("/usr/lib/libc.so.6"))
    assert leftovers.sweep(before, places, proc) == [dead]
    assert running.exists() and not dead.exists()


def test_a_topology_file_is_kept_while_a_hydra_proxy_lives(tmp_path: Path) -> None:
    """Another job's proxy may hand its file to ranks still starting: kept until a
    sweep finds no proxy alive."""
    places = _places(tmp_path)
    shm, tmp = list(places)
    before = leftovers.present(places)
    topology, segment = tmp / "hydra_hwloc_xmlfile_Zz9", shm / "mpich_shm_dead_0"
    topology.write_bytes(b"x")
    segment.write_bytes(b"x")
    proc = tmp_path / "proc"
    _process(proc, 4400)
    (proc / "4400" / "comm").write_text("hydra_pmi_proxy\n")
    assert leftovers.sweep(before, places, proc) == [segment]
    assert topology.exists()
    (proc / "4400" / "comm").write_text("python3\n")    # the proxy's pid, reused
    assert leftovers.sweep(before, places, proc) == [topology]


def test_maps_lists_file_paths_only_and_skips_what_it_cannot_read(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _process(proc, 7, Path("/dev/shm/mpich_shm_x_0"), Path("/dev/shm/gone (deleted)"))
    (proc / "8").mkdir()                                 # ended before its maps was read
    (proc / "self").mkdir()                              # not a pid
    assert leftovers.mapped(proc) == {"/dev/shm/mpich_shm_x_0", "/dev/shm/gone"}


def test_nothing_new_reads_no_maps(tmp_path: Path) -> None:
    places = _places(tmp_path)
    before = leftovers.present(places)
    assert leftovers.sweep(before, places, tmp_path / "no-such-proc") == []



def test_a_killed_open_mpi_launchers_folder_is_found_by_its_pid(tmp_path: Path) -> None:
    (tmp_path / "ompi.4242" / "0").mkdir(parents=True)
    (tmp_path / "ompi.4243").mkdir()
    assert leftovers.launcher_folders(4242, str(tmp_path)) == [tmp_path / "ompi.4242"]
    assert leftovers.launcher_folders(7, str(tmp_path)) == []
