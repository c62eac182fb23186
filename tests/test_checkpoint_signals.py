"""StopRequest: the first SIGTERM / SIGINT only sets a flag (the trainer finishes the step and checkpoints,
tested end to end in test_checkpoint_resume.py); a second one exits at once with 128 + signal."""

import os
import signal
import subprocess
import sys
import textwrap

from helpers import REPO


def test_first_signal_sets_flag_and_restores_handlers():
    from megagspo.checkpoint import StopRequest

    stop = StopRequest()
    before = signal.getsignal(signal.SIGINT)
    stop.install()
    try:
        assert stop.requested() is None
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested() == signal.SIGINT
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGINT) is before


def test_second_signal_exits_at_once():
    script = textwrap.dedent("""
        import os, signal, time
        from megagspo.checkpoint import StopRequest
        stop = StopRequest(); stop.install()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested() == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        print("not reached")
    """)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "received SIGTERM: finishing the current step" in proc.stderr
    assert "second signal (SIGTERM): exiting at once" in proc.stderr
    assert "not reached" not in proc.stdout
