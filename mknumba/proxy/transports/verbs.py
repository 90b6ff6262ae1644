"""Real nodes over RDMA through pyverbs: InfiniBand RC (ordered mode only).

One reliable connection per peer, set up over MPI; per command a data RDMA write, then a 4-byte
flag write on the same queue pair (RC delivers in order; receive blocks poll the flag, no
receiving proxy). EFA SRD (unordered: completion mode, a write with immediate whose receiving
proxy sets the flag, as the ``dma`` and ``sim`` transports' completion mode do) is not written:
an EFA device or ``verbs:completion`` is refused at construction.
GPU memory is registered through dma-buf (cuMemGetHandleForAddressRange), so the NIC reads and
writes it directly. pyverbs is imported lazily: without it (or without an RDMA device; with no
kernel support ``get_device_list()`` raises) :func:`rdma_available` says why.
The pure parts (work requests, connection info) are in :mod:`.verbs_plan` and tested without a NIC.
Untested on hardware here: no RDMA device on our machines.
"""
import ctypes
import os
import time

import numpy as np

from ...errors import MkError
from ..ring import MAX_WINDOWS
from .base import ORDERED, Transport
from .verbs_plan import FlagSource, pack_conn_info, unpack_conn_info, work_requests

CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1


def rdma_available():
    """(True, device name) or (False, the reason) — never raises."""
    try:
        import pyverbs.device as d
    except Exception as e:        # noqa: BLE001
        return False, f"pyverbs is not importable ({e}); install rdma-core's python3-pyverbs"
    try:
        devs = d.get_device_list()
    except Exception as e:        # noqa: BLE001 - no kernel support raises rather than []
        return False, f"get_device_list() failed: {e}"
    if not devs:
        return False, "no RDMA device found"
    want = os.environ.get("MKNUMBA_RDMA_DEVICE")
    names = [x.name.decode() for x in devs]
    if want and want not in names:
        return False, f"MKNUMBA_RDMA_DEVICE={want} not among {names}"
    return True, want or names[0]


class VerbsTransport(Transport):
    name = "verbs"
    completions = (ORDERED,)

    def __init__(self, comm, completion=None, cq_depth=4096, max_outstanding=1024):
        ok, dev = rdma_available()
        if not ok:
            raise MkError(f"verbs transport unavailable: {dev}")
        if "efa" in dev:
            raise MkError(f"verbs transport: {dev} is an EFA device; EFA SRD is not implemented "
                          "(only InfiniBand RC)")
        super().__init__(comm, completion or ORDERED)
        from pyverbs import enums as e
        from pyverbs.cq import CQ
        from pyverbs.device import Context
        from pyverbs.pd import PD
        self.e = e
        self.ctx = Context(name=dev)
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, cq_depth)
        self.port = 1
        self.local = np.zeros((MAX_WINDOWS, 2), np.uint64)      # (addr, lkey)
        self.remote = {}                                       # peer -> uint64[windows, 2]
        self._mrs = []
        self._win_mrs = {}                                     # window id -> its MR
        self.flag_source = FlagSource()
        self._register_host(self.flag_source)
        self.max_outstanding, self.outstanding = max_outstanding, 0
        self.qps = self._connect()

    # -- memory ------------------------------------------------------------------------------------
    def _access(self):
        e = self.e
        return (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ)

    def _register_host(self, src):
        from pyverbs.mr import MR
        mr = MR(self.pd, src.values.nbytes, self._access(), address=src.base)
        self._mrs.append(mr)
        src.lkey = mr.lkey

    def _register_gpu(self, ptr, nbytes):
        """dma-buf registration of GPU memory (peer-memory modules are not needed)."""
        from pyverbs.mr import DmaBufMR
        libcuda = ctypes.CDLL("libcuda.so.1")
        fd = ctypes.c_int(-1)
        rc = libcuda.cuMemGetHandleForAddressRange(ctypes.byref(fd), ctypes.c_uint64(ptr),
                                                   ctypes.c_size_t(nbytes),
                                                   CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                                                   ctypes.c_ulonglong(0))
        if rc != 0:
            raise MkError(f"cuMemGetHandleForAddressRange failed ({rc}): no dma-buf support")
        mr = DmaBufMR(self.pd, nbytes, self._access(), fd=fd.value, offset=0, iova=ptr)
        self._mrs.append(mr)
        return mr

    def _register(self, w):
        ptr = int(w.buf.local.__cuda_array_interface__["data"][0])
        mr = self._win_mrs[w.id] = self._register_gpu(ptr, w.nbytes)
        self.local[w.id] = (ptr, mr.lkey)
        rows = self.comm.mpi.allgather((ptr, mr.rkey))
        for p in self.remote:
            self.remote[p][w.id] = rows[p]

    def _unregister(self, w):
        mr = self._win_mrs.pop(w.id)
        self._mrs.remove(mr)
        mr.close()
        self.local[w.id] = 0
        for p in self.remote:
            self.remote[p][w.id] = 0

    # -- connections -------------------------------------------------------------------------------
    def _connect(self):
        """Exchange connection info over MPI and bring one RC queue pair per peer up."""
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
        from pyverbs.addr import AHAttr, GlobalRoute
        e, comm = self.e, self.comm
        gid = self.ctx.query_gid(self.port, 0)
        lid = self.ctx.query_port(self.port).lid
        peers = [p for p in range(comm.size) if p != comm.rank]
        for p in peers:
            self.remote[p] = np.zeros((MAX_WINDOWS, 2), np.uint64)
        cap = QPCap(max_send_wr=self.max_outstanding * 2, max_recv_wr=self.max_outstanding,
                    max_send_sge=1, max_recv_sge=1)
        qps = {p: QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq,
                                         cap=cap)) for p in peers}
        blobs = [pack_conn_info(lid, self.port, qps[p].qp_num if p in qps else 0, 0, 0,
                                gid.gid if hasattr(gid, "gid") else bytes(16), [])
                 for p in range(comm.size)]
        got = comm.mpi.alltoall(blobs)
        for p in peers:
            info, _ = unpack_conn_info(got[p])
            attr = QPAttr(qp_state=e.IBV_QPS_RTS, cur_qp_state=e.IBV_QPS_RESET)
            attr.dest_qp_num, attr.path_mtu = info["qpn"], e.IBV_MTU_4096
            attr.qp_access_flags = self._access()
            attr.timeout, attr.retry_cnt, attr.rnr_retry = 14, 7, 7
            attr.max_rd_atomic = attr.max_dest_rd_atomic = 16
            attr.ah_attr = AHAttr(port_num=self.port, dlid=info["lid"], is_global=1,
                                  gr=GlobalRoute(dgid=_gid(info["gid"]), sgid_index=0))
            qps[p].to_rts(attr)
        comm.mpi.Barrier()
        return qps

    # -- proxy thread ------------------------------------------------------------------------------
    def submit(self, peer, batch):
        from pyverbs.wr import SGE, SendWR
        self.check_command(peer, batch)
        while self.outstanding >= self.max_outstanding:
            self.progress()
        wrs = work_requests(batch, self.local, self.remote[peer], self.flag_source)
        head = None
        for w in reversed(wrs):      # one chain, one doorbell
            flags = self.e.IBV_SEND_SIGNALED if w.signaled else 0
            wr = SendWR(wr_id=w.wr_id, opcode=w.opcode, num_sge=1,
                        sg=[SGE(w.local_addr, w.length, w.lkey)], send_flags=flags,
                        next_wr=head)
            wr.set_wr_rdma(w.rkey, w.remote_addr)
            head = wr
        self.qps[peer].post_send(head)
        self.outstanding += 1

    def progress(self):
        n, wcs = self.cq.poll(64)
        done = 0
        for wc in wcs[:n]:
            if wc.status != self.e.IBV_WC_SUCCESS:
                raise MkError(f"verbs completion error {wc.status} for command {wc.wr_id}")
            self.outstanding -= 1
            done += 1
        return done

    def flush(self, deadline_ns):
        self._until_sent(deadline_ns, self.progress)

    def quiesce(self, deadline_ns):
        # main thread: the proxy thread's progress() retires the sends
        self._until_sent(deadline_ns, lambda: time.sleep(1e-5))

    def _until_sent(self, deadline_ns, step):
        while self.outstanding:
            step()
            if time.monotonic_ns() > deadline_ns:
                raise MkError("verbs transport: sends did not complete before the timeout")

    def close(self):
        for qp in getattr(self, "qps", {}).values():
            qp.close()
        for mr in self._mrs:
            mr.close()
        self.cq.close()
        self.pd.close()
        self.ctx.close()


def _gid(raw):
    from pyverbs.addr import GID
    g = GID()
    g.gid = ":".join(raw[i:i + 2].hex() for i in range(0, 16, 2))
    return g
