"""MLX's ring hostfile (no MLX): JSON, one list of ``"host:port"`` per rank, rank 0 (the
machine that runs ``appliance serve``) first, as ``mlx.distributed_config`` writes it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Hostfile:
    path: Path
    hosts: tuple[str, ...]
    """Each rank's host (its first address)."""

    @property
    def size(self) -> int:
        return len(self.hosts)


def read(path: str | Path) -> Hostfile:
    """The hostfile at ``path``; ValueError naming what is wrong with it."""
    p = Path(path).expanduser()
    try:
        data = json.loads(p.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read the hostfile {p}: {exc.strerror}") from exc
    except ValueError as exc:
        raise ValueError(f"the hostfile {p} is not JSON: {exc}") from exc
    if not isinstance(data, list) or len(data) < 2:
        raise ValueError(f"the hostfile {p} must be a JSON list with one entry per machine, "
                         "at least two")
    hosts = []
    for rank, entry in enumerate(data):
        addrs = entry if isinstance(entry, list) else [entry]
        if not addrs or not all(isinstance(a, str) and ":" in a for a in addrs):
            raise ValueError(f"the hostfile {p}: rank {rank} must list 'host:port' addresses")
        host, _, port = addrs[0].rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"the hostfile {p}: rank {rank}'s address {addrs[0]!r} is not "
                             "host:port")
        hosts.append(host)
    return Hostfile(p.resolve(), tuple(hosts))
