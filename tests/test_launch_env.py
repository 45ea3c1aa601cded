"""Pure rules of the launch contracts: torchrun/Slurm/explicit placement, the worker env,
Slurm host lists, launch flags, error records. No processes."""

from __future__ import annotations

import json
import os
import signal

import pytest

from disttrain.launch import mpi, records, slurm, summary
from disttrain.launch.config import LaunchConfig, LaunchError, check_port_free, free_port
from disttrain.launch.env import (
    DEFAULT_EXIT_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    PlacementError,
    choose_backend,
    launcher_of,
    resolve_debug,
    resolve_exit_timeout,
    resolve_init_timeout,
    resolve_placement,
    resolve_timeout,
    worker_env,
)
from disttrain.launch.placement import derived_port, port_candidates
from disttrain.launch.threads import usable_cores

TORCHRUN = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


# ---------------------------------------------------------------- torchrun contract
def test_worker_env_round_trips_through_resolve_placement():
    """What the launcher writes is exactly what init() reads back, for every worker."""
    seen = []
    for node_rank in range(2):
        for local_rank in range(3):
            env = worker_env({"PATH": "/bin"}, local_rank=local_rank, nproc_per_node=3,
                             nnodes=2, node_rank=node_rank, master_addr="10.0.0.1",
                             master_port=29500)
            place = resolve_placement(env)
            assert (place.rank, place.local_rank) == (node_rank * 3 + local_rank, local_rank)
            assert (place.world_size, place.local_world_size) == (6, 3)
            assert (place.master_addr, place.master_port, place.source) == (
                "10.0.0.1", 29500, "torchrun")
            assert env["GROUP_RANK"] == str(node_rank) and env["PATH"] == "/bin"
            seen.append(place.rank)
    assert sorted(seen) == list(range(6))


def test_worker_env_keeps_user_settings_and_defaults_threads():
    env = worker_env({"OMP_NUM_THREADS": "4"}, local_rank=0, nproc_per_node=2, nnodes=1,
                     node_rank=0, master_addr="127.0.0.1", master_port=1234)
    assert env["OMP_NUM_THREADS"] == "4" and env["PYTHONUNBUFFERED"] == "1"
    assert worker_env({}, local_rank=0, nproc_per_node=2, nnodes=1, node_rank=0,
                      master_addr="h", master_port=1)["OMP_NUM_THREADS"] == str(
        max(1, usable_cores() // 2))  # the host's usable cores, shared
    assert "OMP_NUM_THREADS" not in worker_env({}, local_rank=0, nproc_per_node=1, nnodes=1,
                                               node_rank=0, master_addr="h", master_port=1)


def test_torchrun_variables():
    place = resolve_placement(TORCHRUN)
    assert (place.rank, place.world_size, place.local_rank, place.local_world_size) == (3, 4, 1, 2)


@pytest.mark.parametrize("env, needle", [
    ({**TORCHRUN, "RANK": "4"}, "RANK=4 is out of range for WORLD_SIZE=4"),
    ({**TORCHRUN, "RANK": "x"}, "RANK='x' is not an integer"),
    ({**TORCHRUN, "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ({**TORCHRUN, "WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE=0 must be ≥ 1"),
    ({k: v for k, v in TORCHRUN.items() if k != "RANK"}, "WORLD_SIZE is set but RANK is not"),
    ({k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}, "set MASTER_ADDR"),
    ({k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}, "MASTER_PORT is not set"),
    ({**TORCHRUN, "MASTER_PORT": "http"}, "MASTER_PORT='http' is not an integer"),
    ({**TORCHRUN, "LOCAL_RANK": "2"}, "LOCAL_RANK=2 is out of range for LOCAL_WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "LOCAL_WORLD_SIZE is not set"),
])
def test_bad_environments_name_the_variable(env, needle):
    with pytest.raises(PlacementError) as info:
        resolve_placement(env)
    assert needle in str(info.value)


def test_master_addr_defaults_to_loopback_only_on_one_node():
    env = {k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}
    with pytest.raises(PlacementError, match="spans several nodes"):
        resolve_placement(env)  # 4 ranks, 2 per node
    one_node = {**env, "LOCAL_WORLD_SIZE": "4"}
    assert resolve_placement(one_node).master_addr == "127.0.0.1"


def test_explicit_arguments_win_and_must_come_in_pairs():
    place = resolve_placement(TORCHRUN, master_addr="10.9.9.9", master_port=4242)
    assert (place.rank, place.master_addr, place.master_port) == (3, "10.9.9.9", 4242)
    place = resolve_placement({}, rank=1, world_size=2, master_addr="127.0.0.1",
                              master_port=5000)
    assert (place.rank, place.world_size, place.source) == (1, 2, "explicit")
    with pytest.raises(PlacementError, match="pass world_size="):
        resolve_placement({}, rank=1)
    with pytest.raises(PlacementError, match="out of range"):
        resolve_placement({}, rank=2, world_size=2, master_addr="h", master_port=1)


def test_plain_python_is_a_world_of_one():
    place = resolve_placement({})
    assert (place.rank, place.world_size, place.master_port, place.source) == (0, 1, None,
                                                                                 "single")


# ---------------------------------------------------------------- Slurm
SLURM = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8",
         "SLURM_JOB_NODELIST": "gpu[07-08,10],cpu5", "SLURM_TASKS_PER_NODE": "2(x3),2",
         "SLURM_NODEID": "2", "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "3"}


def test_slurm_placement_uses_first_node_and_a_step_derived_port():
    place = resolve_placement(SLURM)
    assert (place.rank, place.world_size, place.local_rank, place.local_world_size) == (5, 8, 1, 2)
    assert place.master_addr == "gpu07" and place.source == "slurm"
    assert place.rendezvous_id == "slurm-123456.3"
    assert place.master_port == derived_port("slurm-123456.3")
    assert 20000 <= place.master_port < 40000
    assert place.port_candidates()[0] == place.master_port and len(place.port_candidates()) == 8
    step = {**SLURM, "SLURM_STEP_NODELIST": "n[3-4]", "MASTER_PORT": "29400"}
    assert resolve_placement(step).master_addr == "n3"
    assert resolve_placement(step).master_port == 29400
    assert resolve_placement(step).port_candidates() == (29400,)  # given: used as given


def test_two_steps_of_one_job_derive_different_ports():
    """Overlapping srun steps of one job must not meet on one port."""
    ports = {resolve_placement({**SLURM, "SLURM_STEP_ID": str(s)}).master_port
             for s in range(20)}
    assert len(ports) == 20
    assert port_candidates(39999)[:2] == (39999, 20000)  # wraps inside the range


def test_the_batch_script_of_a_job_is_not_a_task():
    """sbatch's script sees SLURM_PROCID=0 and SLURM_NTASKS, but it is one process: no step."""
    batch = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    assert launcher_of(batch) is None
    assert resolve_placement({**batch, "SLURM_PROCID": "0"}).source == "single"
    assert slurm.batch_tasks(batch) == 8 and slurm.batch_tasks(SLURM) is None


def test_torchrun_variables_win_over_slurm():
    """torchrun started inside an srun step: the per-process torchrun variables decide."""
    assert resolve_placement({**SLURM, **TORCHRUN}).source == "torchrun"
    assert launcher_of({**SLURM, **TORCHRUN}) == "torchrun"


@pytest.mark.parametrize("env, needle", [
    ({**SLURM, "SLURM_PROCID": "8"}, "RANK=8 is out of range for WORLD_SIZE=8"),
    ({**SLURM, "SLURM_NTASKS": "many"}, "SLURM_NTASKS='many' is not an integer"),
    ({k: v for k, v in SLURM.items() if k != "SLURM_NTASKS"}, "SLURM_NTASKS is not set, "
     "but SLURM_STEP_ID=3 says srun started this process"),
    ({k: v for k, v in SLURM.items() if k != "SLURM_PROCID"}, "SLURM_PROCID is not set"),
    ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}, "set MASTER_ADDR"),
    ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"},
     "MASTER_PORT is not set but 8 processes must meet; export MASTER_PORT before srun"),
])
def test_bad_slurm_environments(env, needle):
    with pytest.raises(PlacementError) as info:
        resolve_placement(env)
    assert needle in str(info.value)


# ---------------------------------------------------------------- MPI
OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "OMPI_MCA_ess_base_jobid": "1155137537"}  # as OpenMPI 4.1 sets them
HYDRA = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2",
         "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}


def test_openmpi_on_one_machine_meets_on_loopback_and_a_job_derived_port():
    place = resolve_placement(OMPI)
    assert (place.rank, place.world_size, place.local_rank, place.local_world_size) == (1, 2, 1, 2)
    assert (place.master_addr, place.source) == ("127.0.0.1", "mpi")
    assert place.rendezvous_id == "mpi-1155137537"
    assert place.master_port == derived_port("mpi-1155137537")
    given = resolve_placement({**OMPI, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29501"})
    assert (given.master_addr, given.master_port, given.rendezvous_id) == ("10.0.0.1", 29501,
                                                                           None)


def test_mpich_and_intel_mpi_variables():
    place = resolve_placement(HYDRA)
    assert (place.rank, place.world_size, place.local_rank, place.local_world_size) == (2, 4, 0, 2)
    assert (place.master_addr, place.master_port, place.source) == ("n1", 29500, "mpi")


def test_mpi_comes_before_the_slurm_variables_it_inherits():
    """mpirun inside an allocation: its ranks also see the batch step's SLURM_* variables."""
    assert launcher_of({**SLURM, **OMPI}) == "mpi"
    assert resolve_placement({**SLURM, **OMPI}).rank == 1


@pytest.mark.parametrize("env, needle", [
    ({**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "1"},
     "MASTER_ADDR is not set and OMPI_COMM_WORLD_LOCAL_SIZE=1 of 2 ranks run on this machine; "
     "mpirun does not say where rank 0 runs: pass it with mpirun -x MASTER_ADDR="),
    ({k: v for k, v in OMPI.items() if k != "OMPI_COMM_WORLD_SIZE"},
     "OMPI_COMM_WORLD_SIZE is not set, but OMPI_COMM_WORLD_RANK says an MPI launcher"),
    ({k: v for k, v in OMPI.items() if k != "OMPI_MCA_ess_base_jobid"},
     "MASTER_PORT is not set but 2 processes must meet; pass it with mpirun -x MASTER_PORT="),
    ({k: v for k, v in HYDRA.items() if k != "PMI_RANK"}, "PMI_RANK is not set"),
    ({k: v for k, v in HYDRA.items() if k != "MASTER_ADDR"}, "2 of 4 ranks run on this"),
    ({**OMPI, "OMPI_COMM_WORLD_RANK": "2"}, "RANK=2 is out of range for WORLD_SIZE=2"),
])
def test_bad_mpi_environments_name_the_variable(env, needle):
    assert launcher_of(env) == "mpi"
    with pytest.raises(PlacementError) as info:
        resolve_placement(env)
    assert needle in str(info.value)


def test_launcher_detection():
    assert launcher_of({}) is None and launcher_of({"MASTER_ADDR": "h"}) is None
    assert launcher_of({"WORLD_SIZE": "2"}) == "torchrun"  # incomplete: resolve says so
    assert launcher_of({"SLURM_STEP_ID": "0"}) == "slurm"
    assert launcher_of({"PMI_SIZE": "2"}) == "mpi"
    assert mpi.detect(OMPI) and not mpi.detect(SLURM)


@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("a1", ["a1"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("r[1-2]-c[3,5]", ["r1-c3", "r1-c5", "r2-c3", "r2-c5"]),
    ("x,y[1-2],z", ["x", "y1", "y2", "z"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert slurm.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["n[1-", "n1]", "n[a-b]", "n[5-2]"])
def test_bad_nodelists_raise(bad):
    with pytest.raises(ValueError):
        slurm.expand_nodelist(bad)


def test_expand_tasks_per_node():
    assert slurm.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm.expand_tasks_per_node("4") == [4]


# ---------------------------------------------------------------- timeout, debug, backend
def test_timeout_debug_and_backend_resolution():
    assert resolve_timeout(None, {}) == DEFAULT_TIMEOUT_S
    assert resolve_timeout(None, {"DISTTRAIN_TIMEOUT": "7.5"}) == 7.5
    assert resolve_timeout(3, {"DISTTRAIN_TIMEOUT": "7.5"}) == 3.0
    for bad in ({"DISTTRAIN_TIMEOUT": "soon"}, {"DISTTRAIN_TIMEOUT": "-1"}):
        with pytest.raises(PlacementError, match="DISTTRAIN_TIMEOUT"):
            resolve_timeout(None, bad)
    assert resolve_init_timeout(None, 5.0, {}) == DEFAULT_TIMEOUT_S  # start-up is slower
    assert resolve_init_timeout(None, 900.0, {}) == 900.0
    assert resolve_init_timeout(None, 5.0, {"DISTTRAIN_INIT_TIMEOUT": "30"}) == 30.0
    assert resolve_init_timeout(12, 5.0, {"DISTTRAIN_INIT_TIMEOUT": "30"}) == 12.0
    with pytest.raises(PlacementError, match="DISTTRAIN_INIT_TIMEOUT"):
        resolve_init_timeout(None, 5.0, {"DISTTRAIN_INIT_TIMEOUT": "0"})
    assert resolve_debug(None, {"DISTTRAIN_DEBUG": "1"}) is True
    assert resolve_debug(None, {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}) is True
    assert resolve_debug(None, {"DISTTRAIN_DEBUG": "0"}) is False
    assert resolve_debug(False, {"DISTTRAIN_DEBUG": "1"}) is False
    assert choose_backend(None, {}, cuda_available=True) == "nccl"
    assert choose_backend(None, {}, cuda_available=False) == "gloo"
    assert choose_backend("gloo", {}, cuda_available=True) == "gloo"
    assert choose_backend(None, {"DISTTRAIN_BACKEND": "gloo"}, cuda_available=True) == "gloo"
    with pytest.raises(PlacementError, match="needs CUDA"):
        choose_backend("nccl", {}, cuda_available=False)
    with pytest.raises(PlacementError, match="unknown"):
        choose_backend("tcp", {}, cuda_available=False)


def test_the_backend_follows_the_device_unless_overridden():
    assert choose_backend(None, {}, cuda_available=True, device="cpu") == "gloo"
    assert choose_backend("auto", {}, cuda_available=True, device="cuda") == "nccl"
    assert choose_backend(None, {}, cuda_available=True, device="cuda:1") == "nccl"
    assert choose_backend(None, {}, cuda_available=False, device="auto") == "gloo"
    # Gloo under a GPU job (the Communicator stages CUDA tensors through host memory)
    assert choose_backend("gloo", {}, cuda_available=True, device="cuda") == "gloo"
    assert choose_backend(None, {"DISTTRAIN_BACKEND": "gloo"}, cuda_available=True,
                          device="cuda") == "gloo"
    with pytest.raises(PlacementError, match="device 'cuda' needs CUDA"):
        choose_backend(None, {}, cuda_available=False, device="cuda")


def test_exit_timeout_resolution():
    assert resolve_exit_timeout(None, {}) == DEFAULT_EXIT_TIMEOUT_S
    assert resolve_exit_timeout(None, {"DISTTRAIN_EXIT_TIMEOUT": "4.5"}) == 4.5
    assert resolve_exit_timeout(None, {"DISTTRAIN_EXIT_TIMEOUT": "0"}) == 0.0  # no bound
    assert resolve_exit_timeout(2, {"DISTTRAIN_EXIT_TIMEOUT": "4.5"}) == 2.0
    for bad in ("later", "-1", "inf", "nan"):
        with pytest.raises(PlacementError, match="DISTTRAIN_EXIT_TIMEOUT"):
            resolve_exit_timeout(None, {"DISTTRAIN_EXIT_TIMEOUT": bad})
    with pytest.raises(PlacementError, match="exit_timeout_s="):
        resolve_exit_timeout(-3, {})


# ---------------------------------------------------------------- launch flags
def test_launch_config_rules(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    ok = LaunchConfig(str(script), nproc_per_node=2, nnodes=2, node_rank=1,
                      master_addr="10.0.0.1", master_port=29500)
    assert ok.world_size == 4 and not ok.hosts_store
    assert ok.command()[1:] == [str(script)]
    assert LaunchConfig("json.tool", module=True).command()[1:3] == ["-m", "json.tool"]
    cases = [
        (dict(nproc_per_node=0), "-n/--nproc-per-node must be a positive integer"),
        (dict(node_rank=1), "--node-rank 1 needs --nnodes > 1"),
        (dict(nnodes=2, node_rank=2, master_addr="h", master_port=1), "out of range"),
        (dict(nnodes=2, master_port=1), "needs --master-addr"),
        (dict(nnodes=2, master_addr="h"), "needs --master-port"),
        (dict(master_port=70000), "is not a TCP port"),
        (dict(module=True), "-m expects a module name"),
        (dict(grace_s=-1), "--grace-period"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(ValueError) as info:
            LaunchConfig(str(script), **kwargs)
        assert needle in str(info.value), (kwargs, str(info.value))
    with pytest.raises(ValueError, match="does not exist"):
        LaunchConfig(str(tmp_path / "missing.py"))
    with pytest.raises(ValueError, match="was not found"):
        LaunchConfig("no_such_package_xyz.train", module=True)


def test_port_check_sees_a_listener():
    port = free_port()
    check_port_free(port)  # nobody listens: fine
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        with pytest.raises(LaunchError, match=f"--master-port {port} is already in use"):
            check_port_free(port)


# ---------------------------------------------------------------- records and exit codes
def test_error_records_round_trip_and_read_torch_format(tmp_path):
    record = records.ErrorRecord("ValueError: boom", "Traceback...\nValueError: boom\n", 12.5,
                                 rank=3, host="h", pid=99, flight_file="/f.json",
                                 root_cause="rank 1 died")
    path = records.write_json(tmp_path / "e.json", record.to_json())
    assert records.read_error_record(path) == record
    data = json.loads(path.read_text())  # the part torchrun reads
    assert data["message"]["message"] == "ValueError: boom"
    assert data["message"]["extraInfo"]["timestamp"] == "12"
    torch_made = {"message": {"message": "RuntimeError: x", "extraInfo": {
        "py_callstack": "tb", "timestamp": "5"}}}
    records.write_json(tmp_path / "t.json", torch_made)
    read = records.read_error_record(tmp_path / "t.json")
    assert read is not None and (read.message, read.traceback, read.timestamp) == (
        "RuntimeError: x", "tb", 5.0)
    (tmp_path / "bad.json").write_text("{not json")
    assert records.read_error_record(tmp_path / "bad.json") is None


def test_failure_notice_and_flight_paths(tmp_path):
    assert records.read_failure_notice(tmp_path) is None
    notice = records.FailureNotice(2, "node7", 41, "was killed by SIGKILL")
    records.write_failure_notice(tmp_path, notice)
    assert records.read_failure_notice(str(tmp_path)) == notice
    assert notice.describe() == "rank 2 (pid 41 on node7) was killed by SIGKILL"
    env = {records.FLIGHT_DIR_VAR: str(tmp_path)}
    assert records.flight_file(3, env) == tmp_path / "flight-rank3.json"
    assert f"pid{os.getpid()}" in records.flight_file(3, {}).name


def test_exit_codes_follow_the_shell_convention():
    assert summary.exit_code(-signal.SIGKILL) == 137 and summary.exit_code(3) == 3
    assert summary.describe_exit(-9) == "was killed by SIGKILL"
    assert summary.describe_exit(143) == "exited with code 143 (SIGTERM)"
    assert summary.describe_exit(1) == "exited with code 1"
    assert "DISTTRAIN_EXIT_TIMEOUT" in summary.describe_exit(-signal.SIGALRM)


def test_a_job_whose_launcher_puts_every_rank_here_is_single_host():
    """What keeps Gloo on loopback (launch/netif.py): only a launcher's word counts."""
    one_node = {**SLURM, "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_TASKS_PER_NODE": "2",
                "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n1"}
    assert resolve_placement(one_node).single_host
    assert not resolve_placement(SLURM).single_host  # 4 nodes
    assert resolve_placement(OMPI).single_host  # local size = size
    assert not resolve_placement(TORCHRUN).single_host  # 2 of 4 here
    # WORLD_SIZE alone says nothing about where the ranks run
    assert not resolve_placement({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
                                  "MASTER_PORT": "29500"}).single_host


def test_gloo_stays_on_loopback_when_every_rank_is_here():
    from disttrain.launch.netif import LOOPBACK, gloo_interface_for, interface_with_address

    lo = interface_with_address(LOOPBACK)
    assert lo is not None
    assert gloo_interface_for("127.0.0.1") == lo
    assert gloo_interface_for("no-such-host.invalid", single_host=True) == lo
