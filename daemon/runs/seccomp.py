"""The sandbox's seccomp filter: the system calls that hold memory no other limit counts.

A task's memory is bounded by its rlimits (each process's address space), the `--size` of its
tmpfs mounts and, where there is one, a cgroup. Three kinds of kernel object escape all but the
cgroup: a `memfd_create` file (pages on the kernel's internal shm mount, each file up to
RLIMIT_FSIZE, as many as the task has descriptors), a System V shared memory segment (it
outlives its last detach: attach, fill, detach, repeat) and a System V message queue. With
`memory_mb = 64` a task held 400 MiB each way. So the sandbox refuses those calls with `EPERM`:
a program that needs shared memory uses POSIX `shm_open`, which lives in the sized `/dev/shm`.

The filter is a classic BPF program (no library: libseccomp has no Python binding here). The
command executor hands it to bubblewrap on a pipe (`pipe`, bwrap's `--seccomp FD`), which loads
it right before it execs the task's argv, so it binds the task and everything it starts at no
cost of its own. It checks the architecture:
x86-64 (its x32 numbers too), i386 (the compat entry a 32-bit binary can use, `ipc` included)
and aarch64.
"""

from __future__ import annotations

import errno
import os
import struct

_LD_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_AND = 0x54  # BPF_ALU | BPF_AND | BPF_K
_RET = 0x06  # BPF_RET | BPF_K
_ALLOW = 0x7FFF0000
_DENY = 0x00050000 | errno.EPERM  # SECCOMP_RET_ERRNO
_X32 = 0x40000000

# (audit arch, syscall numbers refused): memfd_create, memfd_secret, shmget, msgget (and ipc)
REFUSED: tuple[tuple[int, tuple[int, ...]], ...] = (
    (0xC000003E, (319, 447, 29, 68)),  # x86-64 (x32 numbers masked to these)
    (0x40000003, (356, 447, 395, 399, 117)),  # i386: shmget, msgget and the ipc multiplexer
    (0xC00000B7, (279, 447, 194, 186)),  # aarch64
)


def program() -> bytes:
    """The filter's instructions (`struct sock_filter`, 8 bytes each), native byte order."""
    ops: list[list[int]] = []  # [code, jt, jf, k]; jumps count the instructions skipped
    to_deny: list[int] = []
    for arch, numbers in REFUSED:
        ops.append([_LD_ABS, 0, 0, 4])  # seccomp_data.arch
        skip = len(ops)
        ops.append([_JEQ, 0, 0, arch])  # jf patched: past this block
        ops.append([_LD_ABS, 0, 0, 0])  # seccomp_data.nr
        if arch == REFUSED[0][0]:
            ops.append([_AND, 0, 0, 0xFFFFFFFF & ~_X32])
        for number in numbers:
            to_deny.append(len(ops))
            ops.append([_JEQ, 0, 0, number])  # jt patched: to the deny
        ops.append([_RET, 0, 0, _ALLOW])
        ops[skip][2] = len(ops) - skip - 1
    ops.append([_RET, 0, 0, _ALLOW])  # another architecture: nothing refused
    ops.append([_RET, 0, 0, _DENY])
    for at in to_deny:
        ops[at][1] = len(ops) - 1 - at - 1
    return b"".join(struct.pack("=HBBI", *op) for op in ops)


def pipe() -> int:
    """A descriptor (close-on-exec: pass it with `pass_fds`) that reads the filter's program,
    for bwrap's `--seccomp FD`; the program (a few hundred bytes) fits the pipe's buffer."""
    read, write = os.pipe2(os.O_CLOEXEC)
    try:
        os.write(write, program())
    finally:
        os.close(write)
    return read
