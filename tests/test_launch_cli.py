"""The command lines: bad input to ``disttrain launch`` gets a clear message and a non-zero
exit before anything is spawned; ``disttrain info`` reports this machine."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

from disttrain.cli import main
from disttrain.comm.cost_model import LinkCosts, save_costs
from disttrain.launch.config import free_port
from tests.launch_scripts.harness import SCRIPTS, json_lines, run_cli

SCRIPT = str(SCRIPTS / "plain.py")


@pytest.mark.parametrize("argv, needle", [
    (["-n", "0", SCRIPT], "-n/--nproc-per-node must be a positive integer"),
    (["-n", "2", "missing_script.py"], "script 'missing_script.py' does not exist"),
    (["-n", "2"], "nothing to run: give a script"),
    (["--node-rank", "1", SCRIPT], "--node-rank 1 needs --nnodes > 1"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--master-port", "29500",
      SCRIPT], "--node-rank 2 is out of range for --nnodes 2"),
    (["--nnodes", "2", "--node-rank", "-1", "--master-addr", "h", "--master-port", "29500",
      SCRIPT], "out of range"),
    (["--nnodes", "2", "--node-rank", "1", "--master-port", "29500", SCRIPT],
     "--nnodes 2 needs --master-addr"),
    (["--nnodes", "2", "--node-rank", "1", "--master-addr", "h", SCRIPT],
     "--nnodes 2 needs --master-port"),
    (["--nnodes", "1:4", SCRIPT], "elastic ranges like 1:4 are not supported"),
    (["-m", SCRIPT], "-m expects a module name like 'pkg.train'"),
    (["--master-port", "99999", SCRIPT], "is not a TCP port"),
    (["--servers", "-1", SCRIPT], "--servers must be a whole number ≥ 0"),
    (["--servers", "1", "--nnodes", "2", "--master-addr", "h", "--master-port", "29500",
      SCRIPT], "--servers starts the servers on this one machine"),
])
def test_bad_launch_input_is_refused_with_a_message(capsys, argv, needle):
    assert main(["launch", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("disttrain launch: error: ") and needle in err, err


def test_port_in_use_is_refused(capsys, tmp_path):
    port = free_port()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        code = main(["launch", "--master-port", str(port), SCRIPT, "ok", str(tmp_path)])
    assert code == 2
    assert f"--master-port {port} is already in use" in capsys.readouterr().err
    assert not list(tmp_path.glob("pid-*"))  # nothing was started


def test_missing_script_from_the_real_command():
    done = run_cli("launch", "-n", "2", "no/such/train.py", timeout=60)
    assert done.returncode == 2
    assert "script 'no/such/train.py' does not exist" in done.stderr


def test_info_reports_this_machine(tmp_path):
    calibration = tmp_path / "costs.json"
    save_costs("torch", LinkCosts(alpha=42e-6, source="test"), calibration)
    done = run_cli("info", "--json", env={"DISTTRAIN_CALIBRATION": str(calibration),
                                          "RANK": "1", "WORLD_SIZE": "2",
                                          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"},
                   timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1  # --json: JSON Lines, its one row on stdout
    facts = json.loads(lines[0])
    assert facts["torch"] == torch.__version__
    assert facts["backends"]["gloo"] is True
    assert facts["backends"]["nccl"] == torch.distributed.is_nccl_available()
    assert facts["cpu"]["logical_cores"] == os.cpu_count()
    numa = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    assert len(facts["cpu"]["numa_nodes"]) == len(numa)
    assert facts["gpus"]["count"] == (torch.cuda.device_count() if torch.cuda.is_available()
                                      else 0)
    if torch.version.cuda is None:  # a CPU build: no NCCL to report
        assert facts["nccl_version"] is None
    else:
        assert facts["nccl_version"].count(".") == 2
    assert facts["calibration"]["stored"] is True
    assert facts["calibration"]["transports"]["torch"]["alpha"] == pytest.approx(42e-6)
    assert facts["launch"]["placement"]["rank"] == 1
    assert facts["launch"]["variables"]["WORLD_SIZE"] == "2"


def test_info_text_names_each_section(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("DISTTRAIN_CALIBRATION", str(tmp_path / "none.json"))
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for needle in (f"torch {torch.__version__}", "backends   gloo: yes", "numa", "gpus",
                   "none stored", "placement  rank 0 of 1"):
        assert needle in out, out


ROLE_SCRIPT = """
import json, os
names = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "DISTTRAIN_PS_SERVERS", "ROLE_NAME",
         "ROLE_RANK", "ROLE_WORLD_SIZE")
print(json.dumps({n: os.environ.get(n) for n in names}), flush=True)
"""


def test_servers_start_after_the_workers_and_everyone_is_told(capfd, tmp_path):
    script = tmp_path / "roles.py"
    script.write_text(ROLE_SCRIPT)
    assert main(["launch", "-n", "2", "--servers", "1", str(script)]) == 0
    seen = json_lines(capfd.readouterr().out)
    assert sorted(seen) == [0, 1, 2]
    for rank, env in seen.items():
        role, index, size = ("worker", rank, "2") if rank < 2 else ("server", rank - 2, "1")
        assert env == {"RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3",
                       "DISTTRAIN_PS_SERVERS": "1", "ROLE_NAME": role,
                       "ROLE_RANK": str(index), "ROLE_WORLD_SIZE": size}


def test_launched_ps_sync_run_reports_from_worker_zero(capfd):
    argv = ["launch", "-n", "2", "--servers", "1", "-m", "disttrain", "run", "--strategy",
            "ps-sync", "--model", "mlp", "--steps", "4", "--log-every", "0"]
    assert main(argv) == 0
    out = capfd.readouterr().out
    assert "[rank 0] result strategy=ps-sync world_size=3 global_batch=32 steps=4" in out
    assert "[rank 0] ps mode=sync workers=2 servers=1 staleness={0: 8}" in out
    assert "[rank 2] result" not in out  # the server's loop reports nothing


def test_the_nccl_version_reads_both_forms_torch_has_returned(monkeypatch):
    from disttrain.launch import info

    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    assert info.nccl_version() == "2.21.5"
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: 22105)
    assert info.nccl_version() == "2.21.5"
