"""``loader/shm/heap.py``: after ``keep_freed_memory`` a process that frees a batch of ~100 KB
objects and makes the next one takes its memory from the heap again, with no page fault; without
it glibc hands the freed heap top back to the kernel every time. Counted in minor page faults of
a fresh interpreter (the thresholds are per process), not timed."""

import subprocess
import sys
import textwrap

import pytest

_CHILD = textwrap.dedent("""
    import resource, sys
    from stallfree.loader.shm import heap as allocator
    kept = allocator.keep_freed_memory() if sys.argv[1] == "1" else None
    again = allocator.keep_freed_memory() if sys.argv[1] == "1" else None
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    def batch():  # a raw batch's samples: 40 objects of 100 KB, each under glibc's first mmap threshold
        return [bytearray(100_000) for _ in range(40)]
    b = batch(); del b
    before = faults()
    for _ in range(5):
        b = batch(); del b
    print(kept, again, faults() - before)
""")


def _run(keep: bool) -> list[str]:
    done = subprocess.run([sys.executable, "-c", _CHILD, "1" if keep else "0"], capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip
    return done.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc thresholds")
def test_freed_batches_stay_in_the_process():
    assert _run(keep=True) == ["True", "False", "0"]  # done once per process; then no fault at all
    kept, again, faults = _run(keep=False)
    assert int(faults) > 5 * 500  # each 4 MB batch faulted in again: ~1,000 4-KiB pages a time
