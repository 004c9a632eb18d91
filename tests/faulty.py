"""Verifiers that misbehave, for the reward pool's tests: module-level functions in a module that imports
nothing heavy, since a pool worker imports it by name on its first check, inside that check's time limit (a
test file importing torch could outlast it on a busy machine)."""
import os
import time


def hang(response, answer):
    time.sleep(1e6)


def boom(response, answer):
    raise RuntimeError(f"boom on {response!r}")


def die(response, answer):
    os._exit(3)  # like a segfault or the OOM killer


def number(response, answer):
    return float(response)  # "nan", "inf", "1e300", "-0.5": no score a reward may be


HOARD = []


def hoard(response, answer):
    HOARD.append(bytearray(int(response) << 20))  # kept after the check, as a parse's leftovers can be
    return 0.0


def resident(response, answer):
    """The worker's resident memory now, as a fraction of its cap (a score in [0, 1])."""
    with open("/proc/self/statm") as f:
        return min(1.0, int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1024 << 20))
