"""Which processes are alive, read from /proc: for tests that no process outlives its server."""
import os


def live(pid: int) -> bool:
    """Running or sleeping: neither gone nor a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children(pid: int) -> set[int]:
    """The live children of `pid`, whichever of its threads started them."""
    found = set()
    for task in os.listdir(f"/proc/{pid}/task") if live(pid) else []:
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found |= {int(p) for p in f.read().split()}
    return {p for p in found if live(p)}


def descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        kids = children(todo.pop()) - found
        found |= kids
        todo += kids
    return found
