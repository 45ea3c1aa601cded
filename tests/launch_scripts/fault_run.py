"""``disttrain run ARGV`` in which one rank SIGKILLs itself on the launcher's first attempt.

``FAULT_KILL=RANK:STEP`` (read by this test script only): that rank kills itself right after
step STEP, before that step's checkpoint, while TORCHELASTIC_RESTART_COUNT is 0. The other
ranks go on into the next collective (or the checkpoint's barrier) and fail there.
"""

import os
import signal
import sys

from disttrain.cli import main
from disttrain.train import spawn

victim, at_step = (int(v) for v in os.environ.get("FAULT_KILL", "-1:-1").split(":"))
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
if first_attempt and int(os.environ["RANK"]) == victim:
    real_train = spawn.train

    def train_then_die(config, comm=None, *, hooks=(), phases=None):
        def kill(record):
            if record.step == at_step:
                os.kill(os.getpid(), signal.SIGKILL)
        return real_train(config, comm, hooks=(*hooks, kill), phases=phases)

    spawn.train = train_then_die
sys.exit(main(["run", *sys.argv[1:]]))
