"""The tutorial ladder (examples/tutorial/) runs as each file's header says, on 2 ranks (in
numba's simulator on CPU-only machines), and each file checks its own result: a wrong result
exits non-zero, which fails these tests; a right one prints a line ending in "OK"."""
import os

import pytest

from mpi_util import ROOT, SharedLaunch, run_mpi

TUTORIAL = os.path.join(ROOT, "examples", "tutorial")
LESSONS = sorted(f for f in os.listdir(TUTORIAL) if f[:2].isdigit() and f.endswith(".py"))


def test_the_ladder_is_whole():
    assert [f[:2] for f in LESSONS] == ["01", "02", "03", "04", "05"], LESSONS


def _check(lesson, out):
    oks = [line for line in out.splitlines() if line.startswith(lesson[:2] + " ")]
    assert len(oks) == 1 and oks[0].endswith(": OK"), out[-3000:]


# In the simulator the lessons share one mpiexec start, one after another.
SIM = SharedLaunch(2)
for _lesson in LESSONS:
    SIM.add(f"test_lesson[{_lesson}]", os.path.join(TUTORIAL, _lesson))


@pytest.mark.parametrize("lesson", LESSONS)
def test_lesson(lesson, request):
    _check(lesson, SIM.output(request))


@pytest.mark.gpu
@pytest.mark.parametrize("lesson", LESSONS)
def test_lesson_on_gpu(lesson):
    """The same lesson on GPUs (the Hopper tile where there is one); two ranks may share one."""
    _check(lesson, run_mpi(os.path.join(TUTORIAL, lesson), 2, timeout=300, simulator=False))
