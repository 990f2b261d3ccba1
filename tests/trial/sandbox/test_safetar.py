"""Tar streams a task controls (its image's work dir, copied out by ``docker cp``), extracted by the
host as root: every member is checked by ``sandbox/safetar.py`` whatever the interpreter's patch
level, and the host's memory stays flat whatever the stream's size. Each attack test extracts a
crafted archive next to a host "victim" dir that must stay untouched; with tarfile's own extraction
(``filter="fully_trusted"``, or the 3.11.7 ``tar`` filter for the hard link to a symlink) the
attacks land. The memory tests run the real ``export_workdir`` and ``tar_into`` against a stand-in
``docker`` CLI (a script that streams or swallows a tar), in a subprocess whose peak RSS is
compared between two work-dir sizes. The whole module: ~4 s idle, ~10 s at a load of 15 on 2 cores.
"""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from polar_trial.sandbox.safetar import Extracted, UnsafeArchive, add_tree, extract


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    buf.seek(0)
    return buf


def _info(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", mode: int = 0o644) -> tarfile.TarInfo:
    i = tarfile.TarInfo(name)
    i.type, i.linkname, i.mode = kind, link, mode
    return i


def _extract(buf: io.BytesIO, dest: Path, **kw) -> Extracted:
    with tarfile.open(fileobj=buf, mode="r|") as tf:
        return extract(tf, dest, **kw)


@pytest.fixture
def dirs(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "secret").write_text("HOST")
    os.chmod(victim / "secret", 0o600)
    dest = tmp_path / "dest"
    dest.mkdir()
    return dest, victim


def _untouched(victim: Path) -> None:
    assert sorted(p.name for p in victim.iterdir()) == ["secret"]
    assert (victim / "secret").read_text() == "HOST"


@pytest.mark.parametrize("name", ["/abs-{victim}/pwned", "../victim/pwned", "a/../../victim/pwned", "./../victim/pwned"])
def test_absolute_and_dotdot_members_are_refused(dirs, name):
    dest, victim = dirs
    name = name.format(victim=victim).replace("/abs-", "")
    with pytest.raises(UnsafeArchive):
        _extract(_tar([(_info(name), b"EVIL")]), dest)
    _untouched(victim)
    assert not (dest.parent / "pwned").exists()


def test_a_member_through_an_earlier_symlink_member_is_refused(dirs):
    """``lnk -> victim`` then ``lnk/pwned``: tarfile's own extraction writes into the victim."""
    dest, victim = dirs
    arc = [(_info("lnk", tarfile.SYMTYPE, str(victim)), None), (_info("lnk/pwned"), b"EVIL"),
           (_info("lnk/secret"), b"OVERWRITTEN")]
    with pytest.raises(UnsafeArchive, match="through a link"):
        _extract(_tar(arc), dest)
    _untouched(victim)
    # a relative link out, and a link to a dir inside that is then replaced: the same
    arc = [(_info("d", tarfile.DIRTYPE, mode=0o755), None), (_info("d/up", tarfile.SYMTYPE, "../../victim"), None),
           (_info("d/up/pwned"), b"EVIL")]
    with pytest.raises(UnsafeArchive):
        _extract(_tar(arc), dest)
    _untouched(victim)


def test_a_file_member_replaces_a_symlink_member_instead_of_writing_through_it(dirs):
    dest, victim = dirs
    arc = [(_info("x", tarfile.SYMTYPE, str(victim / "secret")), None), (_info("x"), b"MINE")]
    _extract(_tar(arc), dest)
    _untouched(victim)
    assert (dest / "x").read_text() == "MINE" and not (dest / "x").is_symlink()


@pytest.mark.parametrize("link", ["{victim}/secret", "../victim/secret", "s"])
def test_hard_links_only_to_a_regular_file_inside(dirs, link):
    """``s`` is a symlink member to the victim: a hard link to it is the 2025 filter bypass."""
    dest, victim = dirs
    arc = [(_info("s", tarfile.SYMTYPE, str(victim / "secret")), None),
           (_info("h", tarfile.LNKTYPE, link.format(victim=victim)), None), (_info("h"), b"OVERWRITE")]
    with pytest.raises(UnsafeArchive):
        _extract(_tar(arc), dest)
    _untouched(victim)
    assert os.stat(victim / "secret").st_nlink == 1


def test_a_hard_link_inside_is_kept(dirs):
    dest, _ = dirs
    got = _extract(_tar([(_info("app/a"), b"data"), (_info("app/b", tarfile.LNKTYPE, "app/a"), None)]), dest, strip=1)
    assert got.hardlinks == 1 and os.stat(dest / "a").st_ino == os.stat(dest / "b").st_ino


def test_devices_and_fifos_are_skipped_and_counted(dirs):
    dest, _ = dirs
    null = _info("null", tarfile.CHRTYPE)
    null.devmajor, null.devminor = 1, 3
    disk = _info("sda", tarfile.BLKTYPE)
    disk.devmajor, disk.devminor = 8, 0
    got = _extract(_tar([(null, None), (disk, None), (_info("fifo", tarfile.FIFOTYPE), None),
                         (_info("ok"), b"fine")]), dest)
    assert got.skipped == 3 and sorted(got.skipped_names) == ["fifo", "null", "sda"]
    assert sorted(p.name for p in dest.iterdir()) == ["ok"]
    assert got.notes() and "3 special file(s)" in got.notes()[0]


@pytest.mark.parametrize("name", ["x" * 300, "a/" * 300 + "f", "d/" + "y" * 5000])
def test_overlong_names_and_deep_paths_are_refused(dirs, name):
    dest, _ = dirs
    with pytest.raises(UnsafeArchive):
        _extract(_tar([(_info(name), b"z")]), dest)


def test_set_id_bits_are_dropped_and_owners_not_restored(dirs):
    dest, _ = dirs
    info = _info("suid", mode=0o6755)
    info.uid = info.gid = 4242
    odd = _info("odd-time")
    odd.mtime = 10**20  # past any time_t: kept as extracted, no crash
    _extract(_tar([(info, b"#!/bin/sh\n"), (odd, b"x")]), dest)
    st = os.stat(dest / "suid")
    assert stat.S_IMODE(st.st_mode) == 0o755 and st.st_uid == os.getuid()
    assert (dest / "odd-time").read_bytes() == b"x"


def test_symlinks_kept_or_only_inside(dirs):
    """``keep``: a venv's absolute link stays a link (never followed); ``inside``: dropped, counted."""
    dest, victim = dirs
    arc = lambda: _tar([(_info("venv/bin", tarfile.DIRTYPE, mode=0o755), None),  # noqa: E731
                        (_info("venv/bin/python", tarfile.SYMTYPE, "/usr/bin/python3"), None),
                        (_info("venv/bin/py", tarfile.SYMTYPE, "python"), None),
                        (_info("up", tarfile.SYMTYPE, "../victim/secret"), None)])
    got = _extract(arc(), dest)
    assert got.symlinks == 3 and os.readlink(dest / "venv/bin/python") == "/usr/bin/python3"
    inside = dest.parent / "inside"
    inside.mkdir()
    got = _extract(arc(), inside, symlinks="inside")
    assert got.symlinks == 1 and got.dropped_links == 2, got
    assert os.readlink(inside / "venv/bin/py") == "python" and not os.path.lexists(inside / "up")


def test_sizes_are_capped_and_zeros_stay_holes(dirs):
    dest, _ = dirs
    big = _info("big")
    big.size = 1 << 40
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.addfile(big)  # a header only: refused before a byte is read
    buf.seek(0)
    with pytest.raises(UnsafeArchive, match="pass"):
        _extract(buf, dest, max_bytes=1 << 30)
    got = _extract(_tar([(_info("zeros"), bytes(8 << 20))]), dest)
    st = os.stat(dest / "zeros")
    assert st.st_size == 8 << 20 and st.st_blocks * 512 < 1 << 20 and got.bytes == 0


def test_add_tree_keeps_links_as_links_and_leaves_special_files_out(tmp_path):
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f").write_text("x")
    os.symlink("/etc", src / "etc-link")
    os.mkfifo(src / "fifo")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w|") as tf:
        left = add_tree(tf, src, "app")
        assert tf.members == []
    buf.seek(0)
    with tarfile.open(fileobj=buf) as tf:
        names = {m.name: m for m in tf.getmembers()}
    assert left == 1 and set(names) == {"app", "app/d", "app/d/f", "app/etc-link"}
    assert names["app/etc-link"].issym() and names["app/etc-link"].linkname == "/etc"


# --- constant memory: the real functions against a stand-in docker CLI -------------------------

FAKE_DOCKER = textwrap.dedent("""\
    #!{python}
    # a stand-in docker CLI: `create` prints an id, `cp ID:DIR -` streams a tar of one file of
    # $FAKE_MB MiB (written in 1 MiB pieces, never held), `cp - ID:/` reads its input to the end
    import os, sys, tarfile
    args = sys.argv[1:]
    if args[0] == "create":
        print("cid0")
    elif args[0] == "cp" and args[1] == "-":
        while sys.stdin.buffer.read(1 << 20):
            pass
    elif args[0] == "cp":
        size = int(os.environ["FAKE_MB"]) << 20
        class Gen:
            left = size
            def read(self, n=-1):
                n = min(self.left, 1 << 20 if n < 0 else n)
                self.left -= n
                return b"x" * n
        with tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as tf:
            d = tarfile.TarInfo("app"); d.type = tarfile.DIRTYPE; d.mode = 0o755; tf.addfile(d)
            f = tarfile.TarInfo("app/big"); f.size = size; tf.addfile(f, Gen())
    """)

MEASURE = textwrap.dedent("""\
    import os, sys
    from pathlib import Path
    from polar_trial.tasks import imagebuild

    def peak_reset():  # VmHWM back to the current RSS (Linux >= 4.0), so each copy is measured alone
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return hwm()

    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])

    fake, mb, work = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    os.environ["FAKE_MB"] = str(mb)
    src = work / "src"
    src.mkdir(parents=True)
    block = os.urandom(1 << 20)  # not zeros: those would be written as holes
    with open(src / "big", "wb") as fh:
        for _ in range(mb):
            fh.write(block)
    base = peak_reset()
    imagebuild.tar_into(fake, "cid0", [(src, "app")])
    into = hwm() - base
    base = peak_reset()
    imagebuild.export_workdir("img", "/app", work / "out", runtime=fake)
    out = hwm() - base
    assert (work / "out" / "big").stat().st_size == mb << 20
    print(into, out)
    """)


def test_build_context_and_work_dir_copies_take_constant_host_memory(tmp_path):
    """16 MiB and 96 MiB work dirs, into and out of a container: the peak RSS of the copying
    process (VmHWM, reset before each copy) grows by the same few MiB (held whole, as before, it grew by the work dir's size:
    over). The issue's bound is 64 MiB per sandbox at any size; 80 MiB more data must cost < 16 MiB.
    ~3 s."""
    fake = tmp_path / "docker"
    fake.write_text(FAKE_DOCKER.format(python=sys.executable))
    fake.chmod(0o755)
    growth = {}
    for mb in (16, 96):
        r = subprocess.run([sys.executable, "-c", MEASURE, str(fake), str(mb), str(tmp_path / f"w{mb}")],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        into_kb, out_kb = map(int, r.stdout.split())
        growth[mb] = (into_kb / 1024, out_kb / 1024)
    for i, what in enumerate(("tar into the container", "work dir out of it")):
        extra = growth[96][i] - growth[16][i]
        assert extra < 16, f"{what}: peak RSS grew {extra:.0f} MiB more for 80 MiB more data ({growth})"
        assert growth[96][i] < 64, f"{what}: +{growth[96][i]:.0f} MiB for a 96 MiB work dir ({growth})"
