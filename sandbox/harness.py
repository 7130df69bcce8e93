import builtins
import json
import os
import signal
import sys

# Trusted code, run as `python -I -S -c` (no site processing, no script directory on sys.path)
# by the trainer. Three stages in the namespace modes:
#   stage 0 (the trainer's child, on the host; moved into the run's cgroups before it may fork): a subreaper,
#     forks stage 1 and writes its uid/gid maps (host root: 0 -> 0 for the judge, 65534 -> 65534 for the
#     program), then supervises (below);
#   stage 1: unshares user, mount, IPC, UTS, network, PID and cgroup namespaces, forks the judge;
#   the JUDGE (pid 1 of the new PID namespace): builds the program's view of the machine, holds the
#     tokens and the tests, never runs the program. When it exits, every process of the run dies.
# In the fallback, stage 0 forks the judge itself. Stage 0 supervises: when its child exits or the trainer closes
# the life pipe (the run's deadline, or the trainer's death), it kills whatever is left below it and reaps it all
# before it exits. Every process of a run descends from stage 0, and as a subreaper it adopts their orphans, so the
# trainer only ever reaps stage 0: nothing is orphaned to the trainer, which matters where it is PID 1 (a
# container's entry process) or a subreaper itself.
# The program runs in a RUNNER: a child forked before the judge reads its secrets (HumanEval,
# MBPP) or a fresh interpreter per case (stdin/stdout), as the unprivileged host uid where the
# trainer is root, with no capabilities, no_new_privs, its own limits and a seccomp filter. The
# judge sees only plain data from the runner.

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 4, 22, 38
PR_SET_SECUREBITS, PR_CAPBSET_DROP, PR_SET_CHILD_SUBREAPER = 28, 24, 36
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x2000000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 4096, 16384, 1 << 18
ATTR_RDONLY, ATTR_NOSUID, ATTR_NODEV, ATTR_NOEXEC, AT_RECURSIVE = 1, 2, 4, 8, 0x8000
SYS_MOUNT_SETATTR, SYS_CAPSET, SYS_CAPGET = 442, 126, 125
DEVICES = ("null", "zero", "full", "random", "urandom")
RUNNER_IN, RUNNER_OUT, MAX_DEPTH = 100, 101, 64
TOOL_OUTPUT_BYTES = 4096  # what a tool call's program prints that comes back (sandbox.SandboxResult.output)
RUN_DEADLINE_WAIT_S = 60.0  # a stdio case cut at the run's deadline: the judge waits for the trainer to end the run
_libc = None


def libc():
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return _libc


def ok(result, what):
    if result < 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags, data=None):
    import ctypes

    args = [s.encode() if isinstance(s, str) else s for s in (source, target, fstype, data)]
    ok(libc().mount(args[0], args[1], args[2], ctypes.c_ulong(flags), args[3]), f"mount {target}")


def mount_setattr(path, attr_set, attr_clr, flags=0):
    import ctypes
    import struct

    attr = ctypes.create_string_buffer(struct.pack("QQQQ", attr_set, attr_clr, 0, 0), 32)
    ok(libc().syscall(SYS_MOUNT_SETATTR, -100, path.encode(), flags, attr, 32), "mount_setattr " + path)


def write_file(path, text):
    with open(path, "w") as f:
        f.write(text)


# ---- stages 0 and 1: the namespaces; only the judge returns from here ----


def enter_namespaces(job, life_fd):
    ready_r, ready_w = os.pipe()  # two pipes: a child never reads back its own byte
    go_r, go_w = os.pipe()
    child = os.fork()
    if child:  # stage 0, on the host: maps for stage 1's user namespace
        os.close(ready_w)
        os.close(go_r)
        if os.read(ready_r, 1) == b"1":
            uid = job["uid"]
            if uid is not None:  # host root: uid 0 stays the judge's, the program gets `uid`
                maps = [("uid_map", f"0 0 1\n{uid} {uid} 1\n"), ("gid_map", f"0 0 1\n{uid} {uid} 1\n")]
            else:  # a user can map only itself (root inside = this user outside)
                maps = [("setgroups", "deny"), ("uid_map", f"0 {os.geteuid()} 1\n"), ("gid_map", f"0 {os.getegid()} 1\n")]
            for name, text in maps:
                write_file(f"/proc/{child}/{name}", text)
            os.write(go_w, b"1")
        supervise(child, life_fd)
    os.close(life_fd)
    os.close(ready_r)
    os.close(go_w)
    libc().prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # a non-root stage 0 must open our /proc files (no secret here)
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWCGROUP
    ok(libc().unshare(flags), "unshare")
    os.write(ready_w, b"1")
    if os.read(go_r, 1) != b"1":
        os._exit(3)
    judge = os.fork()  # pid 1 of the new PID namespace
    if judge:
        os._exit(os.waitstatus_to_exitcode(os.waitpid(judge, 0)[1]) & 0xFF)
    libc().prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
    libc().prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # pid 1 ignores every default-action signal sent from inside


def start_judge(life_fd):
    """The fallback's stage 0: fork the judge (which returns) and supervise it."""
    child = os.fork()
    if child:
        supervise(child, life_fd)
    os.close(life_fd)


def children():
    """This process's children (their pids stay theirs until we reap them)."""
    me, found = os.getpid(), []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    if int(f.read().rsplit(b")", 1)[1].split()[1]) == me:
                        found.append(int(name))
            except (OSError, ValueError, IndexError):
                pass
    return found


def supervise(child, life_fd):
    """Stage 0, a subreaper: wait until `child` exits or the life pipe closes (nothing is ever written to it:
    readable means closed), then kill what is left below us (orphans become our children, so rounds of killing
    our children reach every descendant) and reap it all; exit with `child`'s status. Never returns."""
    import select

    poller, code = select.poll(), 137
    poller.register(life_fd, select.POLLIN)
    try:
        poller.register(os.pidfd_open(child), select.POLLIN)
        poller.poll()
    except OSError:  # no pidfd (Linux < 5.3, the fallback): look every 20 ms
        while not poller.poll(20):
            pid, status = os.waitpid(child, os.WNOHANG)
            if pid:
                code = os.waitstatus_to_exitcode(status)
                break
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:  # children still alive: kill them all, then block until one of them is gone
            for pid in children():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            pid, status = os.wait()
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
    os._exit(code & 0xFF)


def build_view(job):
    """The program's file system, in the judge's mount namespace: everything read-only, nosuid,
    nodev; a fresh /proc that shows a process only to those who may ptrace it (hidepid: not the judge) with
    /proc/sys read-only and the kernel's sensitive files masked (or no /proc at all in namespaces-noproc); a /dev
    of five devices; the run's only writable folder, /tmp, a tmpfs bounded in bytes and inodes (also /dev/shm)
    that dies with the namespace; /run hidden but for the judge's empty HOME; /sys/fs/cgroup hidden (the pool's
    counters would carry bits between runs); the trainer's home and every folder the program's uid cannot search
    covered by an empty tmpfs with the interpreter and packages bound back; the data files known to hold
    solutions masked."""
    view, uid = job["view"], job["uid"] if job["uid"] is not None else 0
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    fresh_proc = job["sandbox"] == "namespaces"
    if fresh_proc:  # before any mask: the kernel refuses a new proc where the visible one is covered
        try:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible")
        except OSError:  # kernels before 5.8 know only the number
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
    keep = [*(f"/dev/{d}" for d in DEVICES), *view["bind_back"], *view["tmp_bind_back"]]
    keep = {path: os.open(path, os.O_PATH) for path in keep}
    for cover in view["cover"]:
        mount("tmpfs", cover, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m,nr_inodes=1024")
        for path in view["bind_back"]:
            if path.startswith(cover + "/"):
                os.makedirs(path, exist_ok=True)
                mount(f"/proc/self/fd/{keep[path]}", path, None, MS_BIND | MS_REC)
    for folder in view["mask_dirs"]:
        mount("tmpfs", folder, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,nr_inodes=2")
    for path in view["mask_files"]:  # a device node on a nodev mount: any open fails
        mount(f"/proc/self/fd/{keep['/dev/null']}", path, None, MS_BIND)
    mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k,nr_inodes=64")
    for name in DEVICES:
        open(f"/dev/{name}", "w").close()
        mount(f"/proc/self/fd/{keep['/dev/' + name]}", f"/dev/{name}", None, MS_BIND)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("shm", "/tmp"),
    ):
        os.symlink(target, f"/dev/{name}")
    mount(
        "tmpfs",
        "/tmp",
        "tmpfs",
        MS_NOSUID | MS_NODEV | MS_NOEXEC,
        f"mode=0700,size={job['tmp_bytes']},nr_inodes={job['tmp_inodes']},uid={uid},gid={uid}",
    )
    for path in view["tmp_bind_back"]:  # an interpreter or venv under /tmp (a CI's fresh venv): bound back read-only,
        # entry by entry into fresh 0755 folders (mktemp's 0700 would stop the uid), built on a tmpfs of their own at
        # /tmp/<first folder>: a mount point, which the program (owner of /tmp) can neither rename nor remove, and
        # read-only once the view is done, so nothing on the judge's import path is the program's (check_import_path)
        top = "/tmp/" + path[len("/tmp/") :].split("/")[0]
        if not os.path.ismount(top):
            os.makedirs(top, exist_ok=True)
            mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m,nr_inodes=4096,uid=0,gid=0")
        os.makedirs(path, exist_ok=True)
        source = f"/proc/self/fd/{keep[path]}"
        for name in os.listdir(source):
            entry, target = os.path.join(source, name), os.path.join(path, name)
            if os.path.islink(entry):
                os.symlink(os.readlink(entry), target)
                continue
            if os.path.isdir(entry):
                os.makedirs(target, exist_ok=True)
            else:
                open(target, "w").close()
            mount(entry, target, None, MS_BIND | MS_REC)
    for fd in keep.values():
        os.close(fd)
    if os.path.isdir("/run"):  # read-only with the rest below: the judge's HOME stays empty
        mount("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=4k,nr_inodes=3")
        os.mkdir(job["judge_home"], 0o755)
    write_file("/proc/sys/user/max_user_namespaces", "0")  # no nested user namespace for the program
    # inotify instances and watches are counted at every level of the user namespaces, up to the trainer's user
    # on the host (128 instances there by default): the run gets its own small share
    write_file("/proc/sys/user/max_inotify_instances", str(job["inotify_instances"]))
    write_file("/proc/sys/user/max_inotify_watches", str(job["inotify_watches"]))
    if fresh_proc:
        for path in ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs"):
            if os.path.exists(path):
                mount(path, path, None, MS_BIND | MS_REC)
                mount_setattr(path, ATTR_RDONLY | ATTR_NOSUID | ATTR_NODEV | ATTR_NOEXEC, 0, AT_RECURSIVE)
        for path in (
            "/proc/kcore",
            "/proc/keys",
            "/proc/timer_list",
            "/proc/latency_stats",
            "/proc/sched_debug",
            "/proc/kallsyms",
        ):
            if os.path.exists(path):
                mount("/dev/null", path, None, MS_BIND)
        masked = ("/proc/acpi", "/proc/scsi", "/sys/firmware", "/sys/fs/cgroup")
    else:
        masked = ("/proc", "/sys/firmware", "/sys/fs/cgroup")
    for path in masked:
        if os.path.isdir(path):
            mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,nr_inodes=2")
    ok(libc().sethostname(b"sandbox", 7), "sethostname")
    mount_setattr("/", ATTR_RDONLY | ATTR_NOSUID | ATTR_NODEV, 0, AT_RECURSIVE)
    mount_setattr("/tmp", 0, ATTR_RDONLY)
    for name in DEVICES:
        mount_setattr(f"/dev/{name}", 0, ATTR_RDONLY | ATTR_NODEV)


# ---- the runner's identity, limits and system calls ----


def drop_identity(job):
    """Called in the runner before any program code: the unprivileged uid where the trainer is
    root (namespace modes), no capabilities (an empty bounding set; root that stays root gets the
    securebits that keep execve from granting any), no_new_privs."""
    import ctypes
    import struct

    c = libc()
    uid = job["uid"] if job["sandbox"] != "fallback" else None
    if uid is None and os.geteuid() == 0:
        # uid 0 stays (inside the namespace, or the fallback's root whose interpreter may live in
        # 0700 folders): never regain capabilities through execve or setuid (SECBIT_NOROOT,
        # NO_SETUID_FIXUP, KEEP_CAPS off, all locked)
        ok(c.prctl(PR_SET_SECUREBITS, 0x2F, 0, 0, 0), "securebits")
    for cap in range(64):
        if c.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0:
            break
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    header = ctypes.create_string_buffer(struct.pack("Ii", 0x20080522, 0), 8)
    ok(c.syscall(SYS_CAPSET, header, ctypes.create_string_buffer(bytes(24), 24)), "capset")
    ok(c.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    data = ctypes.create_string_buffer(24)
    ok(c.syscall(SYS_CAPGET, header, data), "capget")
    if any(struct.unpack("6I", data.raw)):
        raise OSError("capabilities remain after dropping them")


def set_limits(job):
    import resource

    limits = [
        ("RLIMIT_AS", job["memory"]),
        ("RLIMIT_FSIZE", job["fsize"]),
        ("RLIMIT_NOFILE", job["nofile"]),
        ("RLIMIT_CORE", 0),
    ]
    if job["sandbox"] != "fallback":  # counted per user namespace: this run's processes only
        limits.append(("RLIMIT_NPROC", job["processes"]))
    # Charged to the trainer's user on the host as well as to the run (the kernel counts them at every level of
    # the user namespaces): bounded per run, so that no run can take the whole of that user's allowance.
    limits += [("RLIMIT_SIGPENDING", job["signals_queued"]), ("RLIMIT_MSGQUEUE", job["message_queue_bytes"])]
    for name, value in limits:
        resource.setrlimit(getattr(resource, name), (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (job["cpu"], job["cpu"] + 1))


# System calls a program may make (x86_64), an allow-list: what CPython, its standard library and common
# packages use. Everything else is refused by omission, with EPERM (the kernel's own ENOSYS would hide the
# refusal; the new calls glibc uses, with a fallback, are allowed).
# Left out on purpose, among others: mincore (27: which pages of a file are cached, a channel between runs),
# flock (73: the node's run permits are flock'ed files, which a program that found them could hold), ptrace (101),
# syslog (103), uselib (134), vhangup (153), modify_ldt (154), pivot_root (155), _sysctl (156), adjtimex (159),
# chroot (161), acct (163), settimeofday (164), mount/umount2 (165, 166), swapon/swapoff (167, 168), reboot (169), sethostname/
# setdomainname (170, 171), iopl/ioperm (172, 173), the module calls (174-178, 313), quotactl (179), the
# unimplemented 180-185, the legacy AIO calls (206-210, io_pgetevents 333: I/O a process cannot be killed out of,
# and fs.aio-max-nr, a host-wide limit one run could take whole), lookup_dcookie (212), clock_settime (227),
# vserver (236), kexec (246, 320), the keyring
# (248-250), unshare (272), perf_event_open (298), fanotify_init (300), name_to_handle_at/open_by_handle_at
# (303, 304), clock_adjtime (305), setns (308), process_vm_readv/writev (310, 311), kcmp (312), bpf (321),
# userfaultfd (323); from 335 on all but the few listed: io_uring (425-427), the new mount API (428-433, 442),
# pidfd_getfd (438), process_madvise (440), landlock (444-446), memfd_secret (447), process_mrelease (448),
# cachestat (451), ...
OMITTED_BELOW_335 = {
    27,
    73,
    101,
    103,
    134,
    153,
    154,
    155,
    156,
    159,
    161,
    163,
    164,
    165,
    166,
    167,
    168,
    169,
    170,
    171,
    172,
    173,
    174,
    175,
    176,
    177,
    178,
    179,
    180,
    181,
    182,
    183,
    184,
    185,
    206,
    207,
    208,
    209,
    210,
    212,
    227,
    236,
    246,
    248,
    249,
    250,
    272,
    298,
    300,
    303,
    304,
    305,
    308,
    310,
    311,
    312,
    313,
    320,
    321,
    323,
    333,
}
ALLOWED_FROM_335 = {424, 434, 436, 439, 441, 449, 452}  # pidfd_send_signal, pidfd_open, close_range, faccessat2,
# epoll_pwait2, futex_waitv, fchmodat2
SOCKET_FAMILIES = (2, 10)  # AF_INET, AF_INET6 (the run's network namespace is empty); AF_UNIX only as socketpair
ALLOWED_SYSCALLS = sorted((set(range(335)) - OMITTED_BELOW_335) | ALLOWED_FROM_335)
# Answered 0 without being run: msync, fsync, fdatasync, sync, readahead, fadvise64, sync_file_range, syncfs. A
# program's only writable files are on its tmpfs, where they do nothing; on the host's files they would make the
# disk flush, wait uninterruptibly for the host's writeback, or (fadvise DONTNEED) drop pages that an honest run
# beside it then has to read from the disk again. readahead and fadvise WILLNEED (like madvise MADV_WILLNEED, below)
# queue reads that return at once: thousands of them wait in the slot's read throttle after the run's deadline,
# and a page fault behind that queue cannot be killed.
NO_OP_SYSCALLS = (26, 74, 75, 162, 187, 221, 277, 306)
# Answered ENOSYS: clone3 and openat2, whose flags live in memory that BPF cannot read (glibc and CPython use
# clone and openat, or fall back to them).
ENOSYS_SYSCALLS = (435, 437)
O_DIRECT, F_SETFL = 0o40000, 4  # x86_64: reads past the page cache, waited for uninterruptibly
MADV_ALLOWED = ((0, 19), (22, 25))  # madvise: not MADV_COLD (20) or MADV_PAGEOUT (21), which evict others' pages
MADV_WILLNEED = 3  # answered 0 without being run (see NO_OP_SYSCALLS)
RWF_ALLOWED = 0x17  # preadv2/pwritev2: HIPRI, DSYNC, SYNC, APPEND; not NOWAIT (asks the page cache without reading)


def seccomp_program():
    """A classic BPF filter for x86_64 (seccomp_data: nr at 0, arch at 4, args[i] at 16 + 8 i, its low 32 bits
    first): default deny. Allowed: the system calls of ALLOWED_SYSCALLS, with these checks of their arguments:
    socket only for the families of SOCKET_FAMILIES (no AF_UNIX path to a host service, no vsock, netlink, packet,
    ...: EPERM), socketpair only AF_UNIX SOCK_STREAM, clone without a CLONE_NEW* flag, open/openat without O_DIRECT
    and fcntl(F_SETFL) not setting it, madvise only with the advice of MADV_ALLOWED (MADV_WILLNEED: 0, not run),
    preadv2/pwritev2 only with the flags of RWF_ALLOWED (every one of these arguments is an int or is read as one by
    the kernel: the low half is the whole value). NO_OP_SYSCALLS return 0, ENOSYS_SYSCALLS ENOSYS. Any other
    architecture: the process is killed (an x32-ABI call: EPERM)."""
    import struct

    ld, jeq, jset, jge, jgt, ret, and_ = 0x20, 0x15, 0x45, 0x35, 0x25, 0x06, 0x54
    allow, errno_, kill = 0x7FFF0000, 0x00050000, 0x80000000
    eperm, enosys = errno_ | 1, errno_ | 38

    def op(code, jt, jf, k):
        return struct.pack("HBBI", code, jt, jf, k & 0xFFFFFFFF)

    def arg(i):
        return op(ld, 0, 0, 16 + 8 * i)

    def only(nr, block):  # `block` ends in a return on every path; other calls skip it (A still holds nr)
        return [op(jeq, 0, len(block), nr), *block]

    no, yes = op(ret, 0, 0, eperm), op(ret, 0, 0, allow)
    p = [op(ld, 0, 0, 4), op(jeq, 1, 0, 0xC000003E), op(ret, 0, 0, kill)]  # arch == AUDIT_ARCH_X86_64
    p += [op(ld, 0, 0, 0), op(jge, 0, 1, 0x40000000), no]  # the x32 ABI
    for nr in ENOSYS_SYSCALLS:
        p += only(nr, [op(ret, 0, 0, enosys)])
    for nr in NO_OP_SYSCALLS:
        p += only(nr, [op(ret, 0, 0, errno_)])  # errno 0: the call returns 0, not run
    families = [op(jeq, len(SOCKET_FAMILIES) - i, 0, family) for i, family in enumerate(SOCKET_FAMILIES)]
    p += only(41, [arg(0), *families, no, yes])
    p += only(53, [arg(0), op(jeq, 1, 0, 1), no, arg(1), op(and_, 0, 0, 0xF), op(jeq, 1, 0, 1), no, yes])  # socketpair
    p += only(56, [arg(0), op(jset, 1, 0, 0x7E020000), yes, no])  # clone
    p += only(2, [arg(1), op(jset, 0, 1, O_DIRECT), no, yes])  # open
    p += only(257, [arg(2), op(jset, 0, 1, O_DIRECT), no, yes])  # openat
    p += only(72, [arg(1), op(jeq, 0, 3, F_SETFL), arg(2), op(jset, 0, 1, O_DIRECT), no, yes])  # fcntl
    (lo1, hi1), (lo2, hi2) = MADV_ALLOWED
    assert lo1 == 0
    willneed = [op(jeq, 0, 1, MADV_WILLNEED), op(ret, 0, 0, errno_)]
    p += only(28, [arg(2), *willneed, op(jgt, 3, 0, hi2), op(jge, 3, 0, lo2), op(jgt, 1, 0, hi1), yes, no, yes])  # madvise
    for nr in (327, 328):  # preadv2, pwritev2
        p += only(nr, [arg(5), op(jset, 0, 1, ~RWF_ALLOWED), no, yes])
    intervals = []  # the allowed numbers as runs [lo, hi]
    for nr in ALLOWED_SYSCALLS:
        if intervals and intervals[-1][1] == nr - 1:
            intervals[-1][1] = nr
        else:
            intervals.append([nr, nr])
    for lo, hi in intervals:  # nr >= lo and not nr > hi: allow; else the next run
        p += [op(jge, 0, 2, lo), op(jgt, 1, 0, hi), yes]
    p += [no]  # everything else (the kernel's own ENOSYS would hide the filter's refusal)
    return b"".join(p)


def install_seccomp():
    import ctypes
    import struct

    if os.uname().machine != "x86_64":
        return
    code = seccomp_program()
    buffer = ctypes.create_string_buffer(code, len(code))
    fprog = ctypes.create_string_buffer(struct.pack("HxxxxxxQ", len(code) // 8, ctypes.addressof(buffer)), 16)
    ok(libc().prctl(PR_SET_SECCOMP, 2, fprog, 0, 0), "seccomp")  # SECCOMP_MODE_FILTER, after no_new_privs


def become_runner(job):
    drop_identity(job)
    set_limits(job)
    install_seccomp()


# ---- plain data between runner and judge: exact builtin types only, tagged JSON ----


def encode(value, depth=0):
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return {"i": format(value, "x")}
    if kind is float:
        return {"f": value.hex()}
    if kind is complex:
        return {"c": [value.real.hex(), value.imag.hex()]}
    if kind is bytes:
        return {"b": value.hex()}
    if depth < MAX_DEPTH:
        if kind is list or kind is tuple or kind is set or kind is frozenset:
            tag = {list: "l", tuple: "t", set: "s", frozenset: "z"}[kind]
            return {tag: [encode(item, depth + 1) for item in value]}
        if kind is dict:
            return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    raise TypeError(f"not a plain literal: {kind.__name__}")


def decode(obj, depth=0):
    kind = type(obj)
    if obj is None or kind is bool or kind is str:
        return obj
    if kind is not dict or len(obj) != 1 or depth >= MAX_DEPTH:
        raise ValueError("malformed value")
    ((tag, v),) = obj.items()
    if tag == "i" and type(v) is str:
        return int(v, 16)
    if tag == "f" and type(v) is str:
        return float.fromhex(v)
    if tag == "c" and type(v) is list and len(v) == 2 and all(type(x) is str for x in v):
        return complex(float.fromhex(v[0]), float.fromhex(v[1]))
    if tag == "b" and type(v) is str:
        return bytes.fromhex(v)
    if type(v) is list:
        if tag in ("l", "t", "s", "z"):
            items = [decode(item, depth + 1) for item in v]
            return {"l": list, "t": tuple, "s": set, "z": frozenset}[tag](items)
        if tag == "d" and all(type(p) is list and len(p) == 2 for p in v):
            return {decode(p[0], depth + 1): decode(p[1], depth + 1) for p in v}
    raise ValueError("malformed value")


def wait_for(fd, events, deadline):
    """Block until `fd` is ready for `events` (select.POLLIN / POLLOUT); TimeoutError at `deadline` (None: never)."""
    if deadline is None:
        return
    import select
    import time

    poller = select.poll()
    poller.register(fd, events)
    while not poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
        if time.monotonic() >= deadline:
            raise TimeoutError("the case's time limit")


def send(fd, message, deadline=None):
    import select

    data = json.dumps(message).encode()
    data = len(data).to_bytes(8, "big") + data
    while data:
        wait_for(fd, select.POLLOUT, deadline)
        data = data[os.write(fd, data[: 1 << 12] if deadline is not None else data) :]  # a pipe takes 4 KiB at once


def receive(fd, limit, deadline=None):
    import select

    def exactly(n):
        chunks, left = [], n
        while left:
            wait_for(fd, select.POLLIN, deadline)  # readable: os.read returns what is there, without blocking
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                raise EOFError("the other side closed the channel")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    size = int.from_bytes(exactly(8), "big")
    if size > limit:
        raise ValueError("message too large")
    return json.loads(exactly(size))


# ---- the runner (HumanEval, MBPP): the program, its functions served to the judge ----


def runner(job, channel_in, channel_out):
    os.dup2(channel_in, RUNNER_IN)
    os.dup2(channel_out, RUNNER_OUT)
    os.closerange(3, RUNNER_IN)
    os.closerange(RUNNER_OUT + 1, 1 << 16)
    try:
        os.chdir(job["work"])
        os.environ["HOME"] = os.environ["TMPDIR"] = job["work"]  # the judge's are its own empty folder
        become_runner(job)
        libc().prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # nothing secret here; the trainer may scan it
    except BaseException as exc:
        os.write(2, f"sandbox runner setup failed: {exc!r}\n".encode())
        os._exit(3)
    send(RUNNER_OUT, {"ready": True})
    namespace = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(compile(job["program"], "solution.py", "exec"), namespace)
        functions = {n: f for n, f in list(namespace.items()) if type(n) is str and callable(f)}
    except BaseException:
        import traceback

        traceback.print_exc()
        send(RUNNER_OUT, {"loaded": False})
        os._exit(0)
    send(RUNNER_OUT, {"loaded": True, "functions": sorted(functions)})  # every name: star imports add hundreds
    while True:
        name, args, kwargs = receive(RUNNER_IN, 1 << 30)
        try:
            result = functions[name](*map(decode, args), **{k: decode(v) for k, v in kwargs.items()})
            reply = {"value": encode(result)}
        except BaseException as exc:  # SystemExit too: the call failed
            kind = type(exc)
            reply = {"raise": kind.__name__ if getattr(builtins, kind.__name__, None) is kind else "Exception"}
        send(RUNNER_OUT, reply)


# ---- the judge ----


class ProgramFailed(Exception):
    """A call of the program's function failed (the judge's own: the program cannot raise it)."""


class Runner:
    """The judge's end of the runner: its pid, its two pipes, and whether a call ran past the case limit (then the
    runner is killed, and every later call fails at once: the judge still goes through every case)."""

    def __init__(self, pid, channel_out, channel_in, limit, case_timeout):
        self.pid, self.channel_out, self.channel_in = pid, channel_out, channel_in
        self.limit, self.case_timeout, self.alive = limit, case_timeout, True

    def kill(self):
        if self.alive:
            self.alive = False
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)

    def call(self, message):
        import time

        if not self.alive:
            raise ProgramFailed("the runner was stopped at a case's time limit")
        deadline = time.monotonic() + self.case_timeout
        try:
            send(self.channel_out, message, deadline)
            return receive(self.channel_in, self.limit, deadline)
        except TimeoutError:
            self.kill()
            raise ProgramFailed("a call ran past the case's time limit") from None


def proxy(name, runner):
    """The program's function as the tests see it: arguments and result cross the process
    boundary as plain data, so whatever the program does, the judge sees only values. An exception
    of the program is a failure of the call: a builtin Exception type where the tests may expect
    one, ProgramFailed for everything else, never StopIteration or StopAsyncIteration (which would
    end the tests' loops, `all(map(f, xs))`, as if they had passed). A call has `case_timeout` seconds."""

    def call(*args, **kwargs):
        reply = runner.call([name, [encode(a) for a in args], {str(k): encode(v) for k, v in kwargs.items()}])
        if type(reply) is dict and set(reply) == {"value"}:
            return decode(reply["value"])
        kind = getattr(builtins, str(reply.get("raise")) if type(reply) is dict else "", None)
        if (
            isinstance(kind, type)
            and issubclass(kind, Exception)
            and not issubclass(kind, (StopIteration, StopAsyncIteration))
        ):
            raise kind(f"raised by {name}")
        raise ProgramFailed(f"{name} failed")

    call.__name__ = call.__qualname__ = name
    return call


def names_in_order(sources):
    """The names the test code loads, in order of appearance, the names it defines, the names of
    the functions it calls, and the names used as `name.attribute`."""
    import ast

    loads, stored, calls, bases = [], set(), [], set()
    for source in sources:
        nodes = [n for n in ast.walk(ast.parse(source)) if hasattr(n, "lineno")]
        for node in sorted(nodes, key=lambda n: (n.lineno, n.col_offset)):
            if isinstance(node, ast.Name):
                if isinstance(node.ctx, ast.Load):
                    loads.append(node.id)
                else:
                    stored.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                stored.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                stored.update((a.asname or a.name).split(".")[0] for a in node.names)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                calls.append(node.func.id)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                bases.add(node.value.id)
    return loads, stored, calls, bases


def real_modules(names, namespace):
    """Real modules for the names the tests use as modules (`math.isclose`) and do not define."""
    import importlib
    import importlib.util

    for name in sorted(names):
        if name in namespace or hasattr(builtins, name):
            continue
        try:
            if importlib.util.find_spec(name) is not None:
                namespace[name] = importlib.import_module(name)
        except (ImportError, ValueError):
            pass


def function_under_test(tests, namespace):
    """The one name of an MBPP test list that is the program's function: the first name the
    tests load and neither define nor find in the setup code, a module or the builtins; if every
    such name is a builtin (`assert max(3, 5) == 5`), the first function the tests call. None if
    the tests call nothing."""
    loads, stored, calls, bases = names_in_order(tests)
    real_modules((set(loads) - stored) & bases, namespace)
    free = [n for n in loads if n not in stored and n not in namespace]
    for name in free:
        if not hasattr(builtins, name):
            return name
    return next((n for n in calls if n not in stored), None)


FAILURES = "__verifiers_failures__"  # the judge's list of failed checks, a name of the tests' namespace
WHOLE = "__verifiers_whole__"  # the helpers of the rewritten expressions (WholeEvaluation), a name of it too
COMPARISONS = {
    "Eq": lambda a, b: a == b,
    "NotEq": lambda a, b: a != b,
    "Lt": lambda a, b: a < b,
    "LtE": lambda a, b: a <= b,
    "Gt": lambda a, b: a > b,
    "GtE": lambda a, b: a >= b,
    "Is": lambda a, b: a is b,
    "IsNot": lambda a, b: a is not b,
    "In": lambda a, b: a in b,
    "NotIn": lambda a, b: a not in b,
}


class WholeEvaluation:
    """What the expressions rewritten by `whole_expressions` call: every operand has been evaluated already (each
    `capture`d as (True, value) or (False, exception)), and these give the value and raise the exception that
    Python's own short-circuit would have given or raised."""

    @staticmethod
    def capture(thunk):
        try:
            return True, thunk()
        except Exception as exc:
            return False, exc

    @staticmethod
    def value(item):
        if not item[0]:
            raise item[1]
        return item[1]

    def both(self, *items):  # a and b and ...
        for i, item in enumerate(items):
            value = self.value(item)
            if i == len(items) - 1 or not value:
                return value

    def either(self, *items):  # a or b or ...
        for i, item in enumerate(items):
            value = self.value(item)
            if i == len(items) - 1 or value:
                return value

    def choose(self, test, body, orelse):  # body if test else orelse
        return self.value(body if self.value(test) else orelse)

    def compare(self, items, ops):  # a < b < c ...
        left = self.value(items[0])
        for op, item in zip(ops, items[1:]):
            right = self.value(item)
            result = COMPARISONS[op](left, right)
            if not result:
                return result
            left = right
        return result

    def call(self, function, argument, whole_items):
        """`function(argument)`, the argument evaluated after the function as Python does. When the function is the
        builtin all or any, however it was reached (`every = all`, `builtins.all`, `__builtins__['any']`), every item
        is drawn first (`whole_items`: the captures of a generator's items, else None)."""
        if getattr(function, "__name__", "") == "__call__":  # all.__call__(gen): the builtin it is bound to
            function = getattr(function, "__self__", function)
        if function is builtins.all or function is builtins.any:
            if whole_items is not None:
                return self.every(function, whole_items(), True)
            return self.every(function, argument(), False)
        return function(argument())

    def every(self, function, items, captured):
        """all(...) / any(...) over items all drawn first (`captured`: a list of captures; else an iterable, drawn
        to its end here, an exception of one item not stopping the others where the iterator goes on: map does,
        a generator does not)."""
        if not captured:
            iterator, items = iter(items), []
            while True:
                try:
                    items.append((True, next(iterator)))
                except StopIteration:
                    break
                except Exception as exc:
                    items.append((False, exc))
        if function is builtins.all or function is builtins.any:
            wanted = function is builtins.any
            for item in items:
                if bool(self.value(item)) == wanted:
                    return wanted
            return not wanted
        return function(self.value(item) for item in items)  # the test's own all/any


def whole_expressions(tree, wrap_top_level):
    """Rewrite the expressions of test code that would stop calling the program at a failed check: `and`/`or`,
    chained comparisons and `x if c else y` evaluate every operand before combining them, and all()/any() draw
    every item (a generator's items each captured); assert messages, evaluated only when the check failed, are
    dropped. Where: every assert, and every statement of the guarded code (HumanEval: `check`'s body; MBPP: each
    line), not the test's own helper functions (a recursive `n < 2 or f(n - 1)` must stay short-circuited) and
    not class bodies (their names are not visible from the lambdas the rewrite makes). An operand that a lambda
    would change (a walrus, yield, await, super(), locals(), ...) keeps its node as it is."""
    import ast

    unsafe_calls = {"super", "locals", "vars", "dir", "eval", "exec", "globals"}

    def safe(node):
        for sub in ast.walk(node):
            if isinstance(sub, (ast.NamedExpr, ast.Yield, ast.YieldFrom, ast.Await)):
                return False
            if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id in unsafe_calls:
                return False
            if isinstance(sub, ast.comprehension) and sub.is_async:
                return False
        return True

    def helper(name, args):
        return ast.Call(ast.Attribute(ast.Name(WHOLE, ast.Load()), name, ast.Load()), args, [])

    def capture(node):
        lam = ast.Lambda(ast.arguments([], [], None, [], [], None, []), node)
        return helper("capture", [lam])

    class Rewrite(ast.NodeTransformer):
        def __init__(self):
            self.active, self.in_class = wrap_top_level, False

        def scoped(self, node, active, in_class):
            outer = self.active, self.in_class
            self.active, self.in_class = active, in_class
            self.generic_visit(node)
            self.active, self.in_class = outer
            return node

        def visit_FunctionDef(self, node):
            return self.scoped(node, node.name == "check" and not wrap_top_level, False)

        visit_AsyncFunctionDef = visit_FunctionDef

        def visit_ClassDef(self, node):
            return self.scoped(node, False, True)

        def visit_Lambda(self, node):
            return self.scoped(node, self.active, False)

        def visit_Assert(self, node):
            node.msg = None
            return self.scoped(node, not self.in_class, self.in_class)

        def visit_BoolOp(self, node):
            self.generic_visit(node)
            if not self.active or not all(map(safe, node.values)):
                return node
            name = "both" if isinstance(node.op, ast.And) else "either"
            return helper(name, [capture(v) for v in node.values])

        def visit_Compare(self, node):
            self.generic_visit(node)
            if not self.active or len(node.ops) < 2 or not all(map(safe, [node.left, *node.comparators])):
                return node
            items = ast.List([capture(v) for v in [node.left, *node.comparators]], ast.Load())
            ops = ast.Tuple([ast.Constant(type(op).__name__) for op in node.ops], ast.Load())
            return helper("compare", [items, ops])

        def visit_IfExp(self, node):
            self.generic_visit(node)
            if not self.active or not all(map(safe, (node.test, node.body, node.orelse))):
                return node
            return helper("choose", [capture(node.test), capture(node.body), capture(node.orelse)])

        def visit_Assign(self, node):  # `check = lambda candidate: ...`: its body is the guarded code
            self.generic_visit(node)
            if self.active or wrap_top_level:
                return node
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                pairs = [(target, node.value)]
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):  # check, x = lambda c: ..., 0
                    pairs = list(zip(target.elts, node.value.elts))
                for name, value in pairs:
                    if isinstance(name, ast.Name) and name.id == "check" and isinstance(value, ast.Lambda):
                        self.scoped(value, True, False)  # rewrites the lambda's body in place
            return node

        visit_AnnAssign = visit_Assign  # check: object = lambda candidate: ...

        def visit_Call(self, node):  # one argument: all/any are known at run time, by what the function is
            self.generic_visit(node)
            if not (
                self.active
                and len(node.args) == 1
                and not node.keywords
                and not isinstance(node.args[0], ast.Starred)
                and safe(node.func)
                and safe(node.args[0])
            ):
                return node
            items, whole = node.args[0], ast.Constant(None)
            if isinstance(items, ast.GeneratorExp):
                whole = ast.Lambda(
                    ast.arguments([], [], None, [], [], None, []), ast.ListComp(capture(items.elt), items.generators)
                )
            thunk = ast.Lambda(ast.arguments([], [], None, [], [], None, []), items)
            return helper("call", [node.func, thunk, whole])

    return Rewrite().visit(tree)


class NoFeedback:
    """Rewrites test code so that no failure stops it (no feedback to the program: the calls the judge makes do
    not depend on whether an earlier check passed). Every `assert` becomes `try: assert ... except Exception:
    <record>`, also when evaluating it raised (the program's call failed, its value broke the test's own code);
    every statement of the test's body (HumanEval: the body of `check`, and the loops and branches in it; MBPP:
    each line) is wrapped the same way. Left as they are: the bodies of `try` (a test may expect an exception)
    and of `while` (a statement that fails each time would loop forever). Inside one statement, the expressions
    that would stop at a failed check are evaluated whole first (`whole_expressions`)."""

    def __init__(self, wrap_top_level):
        self.wrap_top_level = wrap_top_level

    def wrapped(self, node):
        import ast

        record = ast.parse(f"{FAILURES}.append({getattr(node, 'lineno', 0)})").body[0]
        handler = ast.ExceptHandler(type=ast.Name("Exception", ast.Load()), name=None, body=[record])
        return ast.Try(body=[node], handlers=[handler], orelse=[], finalbody=[])

    def visit(self, node, guarded):
        """Rewrite the statement lists below `node`; `guarded`: each of its statements is wrapped."""
        import ast

        definitions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        kept = (*definitions, ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal, ast.Pass)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "check":
            guarded = True
        elif isinstance(node, (*definitions, ast.Try, ast.While, getattr(ast, "TryStar", ast.Try))):
            guarded = False
        for name in ("body", "orelse", "finalbody"):
            statements = getattr(node, name, None)
            if not isinstance(statements, list) or not statements or not isinstance(statements[0], ast.stmt):
                continue
            for child in statements:
                self.visit(child, guarded)
            setattr(
                node,
                name,
                [
                    self.wrapped(c) if isinstance(c, ast.Assert) or (guarded and not isinstance(c, kept)) else c
                    for c in statements
                ],
            )
        for handler in getattr(node, "handlers", []):
            self.visit(handler, False)

    def compile(self, source, filename):
        import ast

        tree = whole_expressions(ast.parse(source), self.wrap_top_level)
        self.visit(tree, self.wrap_top_level)
        return compile(ast.fix_missing_locations(tree), filename, "exec")


def judge_calls(job, secret_fd, status_fd):
    to_runner_r, to_runner_w = os.pipe()
    from_runner_r, from_runner_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the runner: forked before the secrets are read
        try:
            runner(job, to_runner_r, from_runner_w)
        finally:
            os._exit(0)
    os.close(to_runner_r)
    os.close(from_runner_w)
    with os.fdopen(secret_fd, "rb") as f:
        secret = json.loads(f.read())
    limit = job["message"]
    if receive(from_runner_r, limit) != {"ready": True}:
        return None
    os.write(status_fd, secret["start_token"].encode() + b"\n")
    loaded = receive(from_runner_r, limit)
    if type(loaded) is not dict or loaded.get("loaded") is not True:
        return None
    functions = set(loaded["functions"])
    program = Runner(pid, to_runner_w, from_runner_r, limit, job["case_timeout"])
    failures = []
    namespace = {"__name__": "__test__", "__builtins__": builtins, FAILURES: failures, WHOLE: WholeEvaluation()}
    if job["mode"] == "humaneval":
        entry = job["entry_point"]
        if entry not in functions:
            return None
        for source in (secret["prompt"], secret["prompt_helpers"]):  # the prompt's helpers, never the program's
            try:
                exec(compile(source, "prompt.py", "exec"), namespace)
                break
            except Exception:
                namespace = {"__name__": "__test__", "__builtins__": builtins, FAILURES: failures, WHOLE: WholeEvaluation()}
        loads, stored, _, bases = names_in_order([secret["test"]])
        real_modules((set(loads) - stored) & bases, namespace)
        candidate = namespace[entry] = proxy(entry, program)
        exec(NoFeedback(wrap_top_level=False).compile(secret["test"], "test.py"), namespace)
        try:
            namespace["check"](candidate)
        except Exception:
            failures.append("check")
    else:
        exec(compile(secret["setup"], "setup.py", "exec"), namespace)
        target = function_under_test(secret["tests"], namespace)
        if target is not None:
            if target not in functions:
                return None
            namespace[target] = proxy(target, program)  # shadows a builtin too
        for source in secret["tests"]:
            try:
                exec(NoFeedback(wrap_top_level=True).compile(source, "test.py"), namespace)
            except Exception:
                failures.append("test")
    program.kill()
    return None if failures else secret["pass_token"]  # only now, after every case


STDIO_BOOT = (
    "import sys\n"
    "sys.path.extend(sys.argv[1:]); sys.argv[:] = ['solution.py']\n"
    "import __main__\n"
    "__main__.__file__ = 'solution.py'\n"
    "exec(compile(open('solution.py', encoding='utf-8').read(), 'solution.py', 'exec'), __main__.__dict__)\n"
)


def output_file(job, name):
    """A nameless file for a program's output (memfd; a file in the run's folder where there is none)."""
    fd = os.memfd_create(name) if hasattr(os, "memfd_create") else None
    return open(fd, "w+b") if fd is not None else open(os.path.join(job["work"], ".out"), "w+b")


def start_program(job, stdin, out, stderr):
    """solution.py as a fresh interpreter in the runner's identity (become_runner), its output into `out`."""
    import subprocess

    return subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", STDIO_BOOT, *job["site"]],
        cwd=job["work"],
        stdin=stdin,
        stdout=out,
        stderr=stderr,
        env=dict(os.environ, HOME=job["work"], TMPDIR=job["work"]),
        preexec_fn=lambda: become_runner(job),
    )


def judge_stdio(job, secret_fd, status_fd):
    """Each case runs the program as a fresh interpreter (nothing of the judge in its memory)."""
    import subprocess
    import time

    with os.fdopen(secret_fd, "rb") as f:
        secret = json.loads(f.read())
    os.write(status_fd, secret["start_token"].encode() + b"\n")  # from here on, anything is the program's failure
    with open(os.path.join(job["work"], "solution.py"), "w", encoding="utf-8") as f:
        f.write(job["program"])
    deadline = time.monotonic() + job["timeout"]
    failed = False  # every case runs whatever the earlier ones did: the program learns no verdict
    for stdin_text, expected in zip(secret["inputs"], secret["outputs"]):
        with output_file(job, "case-output") as out:
            proc = start_program(job, subprocess.PIPE, out, subprocess.DEVNULL)
            left = deadline - time.monotonic()
            try:
                proc.communicate(stdin_text.encode(), timeout=max(0.05, min(job["case_timeout"], left)))
            except subprocess.TimeoutExpired:  # the case's limit: it failed, the next one runs all the same
                proc.kill()
                proc.wait()
                if job["case_timeout"] >= left:  # the run's deadline: no time is left for another case. The trainer's
                    time.sleep(RUN_DEADLINE_WAIT_S)  # own deadline ends the run (a timeout, as for a program still
                    return None  # running); exiting now would race it and could read as a failed run
                failed = True
                continue
            out.seek(0)
            if proc.returncode != 0 or out.read(job["fsize"] + 1).split() != expected.encode().split():
                failed = True
    return None if failed else secret["pass_token"]


def judge_tool(job, secret_fd, status_fd):
    """A tool call (tools.py's python): the program runs once as a fresh interpreter, stdin empty, its stdout and
    stderr together in a nameless file, and the first TOOL_OUTPUT_BYTES of it go to this process's stdout (the
    trainer's file). A program still running at the run's deadline is the trainer's to end (a timeout)."""
    import subprocess

    with os.fdopen(secret_fd, "rb") as f:
        secret = json.loads(f.read())
    os.write(status_fd, secret["start_token"].encode() + b"\n")
    with open(os.path.join(job["work"], "solution.py"), "w", encoding="utf-8") as f:
        f.write(job["program"])
    with output_file(job, "tool-output") as out:
        proc = start_program(job, subprocess.DEVNULL, out, subprocess.STDOUT)
        try:
            proc.wait(timeout=job["timeout"] + RUN_DEADLINE_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return None
        out.seek(0)
        os.write(1, out.read(TOOL_OUTPUT_BYTES))
    return secret["pass_token"] if proc.returncode == 0 else None


def check_import_path(job):
    """Refuse to start (before the runner exists) unless nothing the judge imports can be the program's: every
    folder on the judge's sys.path is on a read-only mount and (root trainer) not owned by the program's uid (a
    non-root trainer's program is uid 0 of the namespace, owner of the trainer's files: there the read-only
    mount is what holds), and on the way
    to it, every folder the program could change (writable mount, and its uid owns it or anyone may write it)
    leads on only through a mount point (which cannot be renamed or removed)."""
    import stat

    program_uid = job["uid"] if job["uid"] is not None else 0
    for entry in dict.fromkeys(p for p in sys.path if p):
        if not os.path.exists(entry):
            continue
        real = os.path.realpath(entry)
        info = os.stat(real)
        if not os.statvfs(real).f_flag & os.ST_RDONLY or (job["uid"] is not None and info.st_uid == program_uid):
            raise RuntimeError(f"judge import path {entry} is not read-only or is the program's")
        parts = real.strip("/").split("/")
        for i in range(len(parts)):
            folder, child = "/" + "/".join(parts[:i]), "/" + "/".join(parts[: i + 1])
            f = os.stat(folder)
            writable = (
                f.st_uid == program_uid or f.st_mode & stat.S_IWOTH or (f.st_gid == program_uid and f.st_mode & stat.S_IWGRP)
            )
            if writable and not os.statvfs(folder).f_flag & os.ST_RDONLY and not os.path.ismount(child):
                raise RuntimeError(f"judge import path {entry}: {child} can be replaced by the program")


def main():
    import resource

    status_fd, job_fd, secret_fd, go_fd, life_fd = map(int, sys.argv[1:6])
    # every process of the run is the OOM killer's first choice, never the trainer (inherited; raising it needs no
    # privilege; in the namespace modes the program's /proc is read-only, so it stays; the fallback's program may
    # lower it to the trainer's where the trainer lacks CAP_SYS_RESOURCE: docs/verifiers.md). Written while this
    # process is still dumpable: an undumpable one's /proc files are root's, closed to a non-root trainer's.
    write_file("/proc/self/oom_score_adj", "1000")
    libc().prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no /proc/<judge>/mem, fd, environ for the runner
    with os.fdopen(job_fd, "rb") as f:  # both are nameless files: no other process can open them
        job = json.loads(f.read())
    if os.read(go_fd, 1) != b"1":  # the trainer has moved us into the run's cgroups: fork only after that
        os._exit(3)
    os.close(go_fd)
    libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # stage 0 (not inherited by its children)
    if job["sandbox"] != "fallback":
        enter_namespaces(job, life_fd)
        build_view(job)
    else:
        start_judge(life_fd)
    for name, value in (("RLIMIT_NOFILE", job["nofile"]), ("RLIMIT_CORE", 0), ("RLIMIT_AS", job["memory"])):
        resource.setrlimit(getattr(resource, name), (value, value))
    sys.path.extend(job["site"])
    os.chdir("/")
    if job["sandbox"] != "fallback":
        check_import_path(job)
    try:  # the pass token, returned by the judge only after the last test passed
        judge = {"stdio": judge_stdio, "tool": judge_tool}.get(job["mode"], judge_calls)
        passed = judge(job, secret_fd, status_fd)
    except BaseException:
        import traceback

        try:
            traceback.print_exc()
        except BaseException:
            pass
        passed = None
    if passed:
        os.write(status_fd, passed.encode() + b"\n")
    os._exit(0)


if __name__ == "__main__":
    main()
