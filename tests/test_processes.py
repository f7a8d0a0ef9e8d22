"""The test suite's launcher runs (tests/processes.py): a rendezvous port taken by another process between
``free_port`` and the launcher's bind is replaced, and the run goes on."""

from __future__ import annotations

import os
import socket
import sys

import pytest
from processes import run_launcher, run_launcher_once

pytestmark = pytest.mark.slow


def test_a_launcher_whose_rendezvous_port_is_taken_runs_again_on_a_fresh_one(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("import pathlib, sys\nimport torch.distributed as d\nd.init_process_group('gloo')\n"
                      "(pathlib.Path(sys.argv[1]) / f'rank{d.get_rank()}').write_text('done')\n"
                      "d.destroy_process_group()\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(taken.getsockname()[1]), str(script), str(tmp_path)]
        with pytest.raises(AssertionError, match="(?i)address already in use"):  # the control: that port fails
            run_launcher_once(cmd, tmp_path, env, timeout=120)
        assert not list(tmp_path.glob("rank*"))
        run_launcher(cmd, tmp_path, env, timeout=120)
    assert sorted(p.name for p in tmp_path.glob("rank*")) == ["rank0", "rank1"]  # both processes ran
