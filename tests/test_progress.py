"""The progress line of long commands: in place on a terminal, one line per interval in a log."""

import io

from specd.progress import Progress


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_one_line_per_interval_and_the_last_state():
    log, clock = io.StringIO(), FakeClock()
    progress = Progress(log, interval_s=30, clock=clock)
    for step in range(1, 101):  # a step a second
        clock.now = float(step)
        progress.update(f"step {step}/100")
    progress.close()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert lines == ["step 1/100", "step 31/100", "step 61/100", "step 91/100", "step 100/100"]


def test_a_final_update_is_written_at_once():
    log, clock = io.StringIO(), FakeClock()
    progress = Progress(log, interval_s=30, clock=clock)
    progress.update("a")
    progress.update("done", final=True)
    progress.close()
    assert log.getvalue().splitlines() == ["a", "done"]


def test_a_terminal_redraws_one_line_in_place():
    screen, clock = Terminal(), FakeClock()
    progress = Progress(screen, clock=clock)
    assert progress.terminal and progress.interval_s < 1
    for step in range(5):
        clock.now = step
        progress.update(f"step {step}")
    progress.close()
    out = screen.getvalue()
    assert out.count("\n") == 1 and out.endswith("\n")
    assert out.count("\r") == 5 and "step 4" in out
