"""Several test programs' runs ("sets") in one mpiexec start, one after another:

    mpiexec -n N python -m mpi4py tests/mpi/launch_sets.py SET [/ SET ...]
    SET: [NAME=VALUE ...] PROGRAM [ARG ...]

Each set runs PROGRAM (a path, relative to tests/mpi or absolute) as ``__main__`` with
``sys.argv = [PROGRAM, ARG, ...]`` and the NAME=VALUE environment variables (upper-case names,
before the program; ``NAME=`` unsets one), read by ``mk.init`` at the set's start: a set chooses
its own layout (``MKNUMBA_GPUS_PER_NODE``, ``MKNUMBA_TRANSPORT``). The environment, sys.argv and
sys.path are restored after each set. Used by ``mpi_util.SharedLaunch``: later sets skip the
start (mpiexec, imports, the library's first-use work).

Every line a set writes to stdout or stderr through Python is prefixed ``<set>| ``; the runner
writes ``<set>| BEGIN rank <r>`` before a set and ``<set>| END rank <r> <seconds>s`` after it returns (a
``SystemExit`` of 0 or None counts as returning). A failing set takes the job down (mpi4py's
``-m``, or the program's own ``Comm`` abort), so the first set without an END on every rank is
the one that failed, and later sets did not run.
"""
import os
import re
import runpy
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = re.compile(r"[A-Z_][A-Z0-9_]*=")


class Prefixed:
    """A text stream that writes whole lines, each prefixed, to ``stream``."""

    def __init__(self, stream, prefix):
        self.stream, self.prefix, self.part = stream, prefix, ""

    def write(self, s):
        lines = (self.part + s).split("\n")
        self.part = lines.pop()
        if lines:
            self.stream.write("".join(f"{self.prefix}{line}\n" for line in lines))
            self.stream.flush()
        return len(s)

    def flush(self):
        self.stream.flush()

    def close(self):
        if self.part:
            self.write("\n")

    def __getattr__(self, name):          # fileno, isatty, encoding ...: the real stream's
        return getattr(self.stream, name)


def split_sets(argv):
    sets, cur = [], []
    for a in argv:
        if a == "/":
            sets.append(cur)
            cur = []
        else:
            cur.append(a)
    sets.append(cur)
    return [s for s in sets if s]


def run_set(index, words, rank):
    env = {}
    while words and ENV.match(words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    program = words[0] if os.path.isabs(words[0]) else os.path.join(HERE, words[0])
    saved = dict(os.environ), list(sys.argv), list(sys.path), sys.stdout, sys.stderr
    for name, value in env.items():
        if value:
            os.environ[name] = value
        else:
            os.environ.pop(name, None)
    sys.argv = [program, *words[1:]]
    sys.path.insert(0, os.path.dirname(program))
    out, err = Prefixed(saved[3], f"{index}| "), Prefixed(saved[4], f"{index}| ")
    sys.stdout, sys.stderr = out, err
    try:
        print(f"BEGIN rank {rank}", flush=True)
        t0 = time.perf_counter()
        try:
            runpy.run_path(program, run_name="__main__")
        except SystemExit as e:
            if e.code not in (None, 0):
                raise
        print(f"END rank {rank} {time.perf_counter() - t0:.1f}s", flush=True)
    finally:
        out.close()
        err.close()
        os.environ.clear()
        os.environ.update(saved[0])
        sys.argv, sys.path[:], sys.stdout, sys.stderr = saved[1], saved[2], saved[3], saved[4]


def main():
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    for index, words in enumerate(split_sets(sys.argv[1:])):
        run_set(index, words, world.Get_rank())
        world.Barrier()


if __name__ == "__main__":
    main()
