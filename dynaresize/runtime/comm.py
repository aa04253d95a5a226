"""Control plane (MPI) and data plane (torch.distributed) of one job.

MPI carries small Python objects: the rendezvous, role tables, stage times, samples, timeline
events. torch.distributed carries tensors: gradients, weights, staged state.

mpi4py is imported when a ControlPlane is made, never at module import: inference engines spawn
processes that re-import modules, and an MPI initialisation there was measured to hang them.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta


def in_mpi_job() -> bool:
    """True if this process is one of several ranks started by mpiexec or srun."""
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"):
        if int(os.environ.get(var, "1") or 1) > 1:
            return True
    return int(os.environ.get("SLURM_STEP_NUM_TASKS", "1") or 1) > 1 and "SLURM_STEP_ID" in os.environ


# Open MPI 5's ob1 can crash inside MPI_Init when a message on MPI_COMM_WORLD arrives from a rank
# released from the start-up fence before this one, which has not set that communicator up yet
# (open-mpi/ompi issues 11438, 12495). Seen under srun only, in requeued attempts
# (docs/guide/slurm.md). The fence's release reaches every rank within milliseconds: a rank
# started by srun waits this long before its first message.
SRUN_FIRST_MESSAGE_DELAY_S = 1.0


class ControlPlane:
    def __init__(self):
        from mpi4py import MPI
        if "SLURM_STEP_ID" in os.environ:
            time.sleep(SRUN_FIRST_MESSAGE_DELAY_S)
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.local_rank = node.Get_rank()
        node.Free()
        self.clock_offset = 0.0
        self.t0 = 0.0

    # --- waiting -----------------------------------------------------------------------------
    # Open MPI's blocking calls poll at full speed. A rank that waits for the others (a rollout
    # rank done before the train step, ranks waiting for rank 0's start-up) would take a core
    # from the ranks still working wherever ranks share cores: a CPU run starts more ranks than
    # there are cores. So every wait below is a test of a request with a sleep between tests,
    # growing to WAIT_POLL_MAX_S: at most that much latency on a control plane whose messages
    # come once or a few times an iteration.
    WAIT_POLL_MAX_S = 1e-3

    def _wait_until(self, done) -> None:
        pause = 2e-5
        while not done():
            time.sleep(pause)
            pause = min(2 * pause, self.WAIT_POLL_MAX_S)

    def _all_arrived(self) -> None:
        """Return once every rank has reached this point (a barrier that does not spin)."""
        self._wait_until(self.comm.Ibarrier().Test)

    # --- collectives on Python objects -----------------------------------------------------
    # Each waits for every rank to arrive first (the politely waiting barrier above); the
    # collective itself then completes at once.
    def bcast(self, obj, root: int = 0):
        self._all_arrived()
        return self.comm.bcast(obj, root=root)

    def allgather(self, obj) -> list:
        self._all_arrived()
        return self.comm.allgather(obj)

    def gather(self, obj, root: int = 0):
        self._all_arrived()
        return self.comm.gather(obj, root=root)

    # --- point to point on Python objects (tail migration) ---------------------------------
    def post(self, obj, dest: int, tag: int):
        """Send `obj` to `dest` without waiting for it to be received: wait() on the returned
        request before the iteration ends."""
        return self.comm.isend(obj, dest=dest, tag=tag)

    def receive(self, tag: int) -> tuple[object, int]:
        """The next object sent to this rank with `tag`, from whichever rank sent first, and that rank."""
        status = self.MPI.Status()
        self._wait_until(lambda: self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=tag, status=status))
        return self.comm.recv(source=status.Get_source(), tag=tag), status.Get_source()

    def poll(self, tag: int) -> tuple[object, int] | None:
        """Like receive, if an object with `tag` has arrived; None at once otherwise."""
        status = self.MPI.Status()
        if not self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=tag, status=status):
            return None
        return self.comm.recv(source=status.Get_source(), tag=tag), status.Get_source()

    def barrier(self) -> None:
        self._all_arrived()

    def abort(self, code: int = 1) -> None:
        """End every rank of the job (a rank blocked in a collective would otherwise hang)."""
        sys.stdout.flush()
        sys.stderr.flush()
        self.comm.Abort(code)

    # --- clocks ----------------------------------------------------------------------------
    def align_clocks(self, origin: float | None = None, rounds: int = 8) -> None:
        """Estimate this rank's offset to rank 0's clock (min round-trip ping-pong), set t0.

        Timeline times are `now()`: seconds since the job's start on rank 0's clock, or since
        `origin` (rank 0's: a Unix time), the start of a resumed run's first attempt.
        """
        comm = self.comm
        best_rtt, offset = float("inf"), 0.0
        for peer in range(1, self.size):
            for _ in range(rounds):
                if self.rank == 0:
                    comm.recv(source=peer, tag=7)
                    comm.send(time.time(), dest=peer, tag=8)
                elif self.rank == peer:
                    t_send = time.time()
                    comm.send(None, dest=0, tag=7)
                    t_root = comm.recv(source=0, tag=8)
                    t_recv = time.time()
                    if t_recv - t_send < best_rtt:
                        best_rtt, offset = t_recv - t_send, t_root - (t_send + t_recv) / 2
        self.clock_offset = offset
        self.t0 = self.bcast((time.time() if origin is None else origin) if self.rank == 0 else None)

    def now(self) -> float:
        return time.time() + self.clock_offset - self.t0

    # --- data plane --------------------------------------------------------------------------
    def init_data_plane(self, device: str, timeout_s: float = 300) -> str:
        """torch.distributed over the same ranks: rank 0 picks a free port and broadcasts it."""
        import torch
        import torch.distributed as dist

        backend = "nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            torch.cuda.set_device(self.local_rank)
        self.hostnames = self.allgather(socket.gethostname())
        host, port = self._free_address()
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.size,
                                timeout=timedelta(seconds=timeout_s))
        return backend

    def make_store(self, timeout_s: float = 300):
        """A key-value store served by a thread of rank 0 (torch.distributed.TCPStore), every rank
        a client: an atomic `add` there needs no other rank to take part, as a claim of work
        stealing needs (a collective would wait for the busiest rank). Collective to create."""
        import torch.distributed as dist

        host, port = self._free_address()
        return dist.TCPStore(host, port, self.size, is_master=self.rank == 0,
                             timeout=timedelta(seconds=timeout_s))

    def _free_address(self) -> tuple[str, int]:
        """A free port on rank 0, at the address the other ranks reach it by (broadcast)."""
        address = None
        if self.rank == 0:
            host = socket.gethostname() if len(set(self.hostnames)) > 1 else "127.0.0.1"
            with socket.socket() as s:
                s.bind(("", 0))
                address = socket.gethostbyname(host), s.getsockname()[1]
        return self.bcast(address)

