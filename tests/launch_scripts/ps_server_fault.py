"""``disttrain run ARGV`` in which a parameter server SIGKILLs itself mid-run.

``PS_SERVER_KILL=RANK:VERSION`` (read by this test script only): the server on that rank
kills itself when it has applied VERSION updates, while the workers are still training.
"""

import os
import signal
import sys

from disttrain.cli import main
from disttrain.parallel.parameter_server import server

victim, at_version = (int(v) for v in os.environ.get("PS_SERVER_KILL", "-1:-1").split(":"))
if int(os.environ["RANK"]) == victim:
    real_apply = server.ParameterServer._apply

    def apply_then_die(self, key):
        real_apply(self, key)
        if self.shard.version == at_version:
            os.kill(os.getpid(), signal.SIGKILL)

    server.ParameterServer._apply = apply_then_die
sys.exit(main(["run", *sys.argv[1:]]))
