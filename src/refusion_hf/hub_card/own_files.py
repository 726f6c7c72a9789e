"""What `refusion publish` may read of a source folder: the folder's own files, and nothing from outside it.

A published folder is uploaded by `--push`, so no content from outside the source folder may reach it. The loaders
that read the folder (transformers' `from_pretrained` and `AutoTokenizer`, chat templates under
`additional_chat_templates/` included) follow symbolic links and read hard-linked files like any other. So before
anything is read, the whole folder is walked (the standard library's `os.walk`, not following links) and these are
refused by name, as one `CardInputError`:

* a symbolic link, at any depth, whose target (every link on the way resolved, `os.path.realpath`) lies outside the
  folder: a link to a file, to a directory, or through `..`. A link to a file or directory inside the folder is read
  as that file or directory (whose own entries are walked where they are);
* a hard-linked file (`st_nlink` > 1) unless all its names are inside the folder, which the walk proves by finding as
  many names of it (same device and inode) as it has links. Otherwise the same content is a file elsewhere, and
  publish cannot tell a hard-link copy of a checkpoint from a hard link to `/etc/shadow`: it is refused, with the fix
  (replace it by a copy of its own);
* a symbolic link that leads nowhere: a loop (`chat_template.jinja -> chat_template.jinja`, or through other
  links) or a missing target; the loaders would skip it silently;
* a mount inside the folder, of a directory or of a single file, of another file system or a bind mount within the
  folder's own (which has the same device, and which `os.path.ismount` misses): every mount point listed in the
  kernel's `/proc/self/mountinfo` inside the folder is refused, and every directory the walk meets is compared by
  device against the folder's own (a file's device is not: on overlayfs, the file system of container images, a
  file reports its layer's device);
* a directory the walk cannot read;
* anything else that is not a regular file or a directory (FIFO, socket, device).

What is checked is the folder before publish reads it: a folder that someone changes while publish runs is not
guarded against.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import stat
from pathlib import Path

from .errors import CardInputError

OWN_FILES_ONLY = "publish copies only the folder's own files"
MOUNT_INFO = "/proc/self/mountinfo"


def mount_points(mount_info: str = MOUNT_INFO) -> list[str]:
    """Every mount point of this process's mount namespace (field 5 of mountinfo, its octal escapes undone); [] where
    the kernel has no such file (not Linux): the device comparison alone is left there."""
    try:
        with open(mount_info, encoding="utf-8", errors="surrogateescape") as table:
            lines = table.read().splitlines()
    except FileNotFoundError:
        return []
    unescape = functools.partial(re.sub, r"\\([0-7]{3})", lambda octal: chr(int(octal[1], 8)))
    return [unescape(line.split(" ")[4]) for line in lines if line.count(" ") >= 5]


def check_own_files(folder: Path, flag: str) -> None:
    """Refuse (`CardInputError`, naming the entry and the fix) a `folder` holding anything whose content is not its
    own (see the module docstring)."""
    root = Path(os.path.realpath(folder))

    def refuse(relative: str, what: str) -> None:
        raise CardInputError(f"{flag} {folder}: {relative} {what}")

    def unreadable(error: OSError) -> None:
        name = os.path.relpath(error.filename, root) if error.filename else "a subfolder"
        refuse(name, f"cannot be read ({error.strerror}); make it readable or remove it.")

    def mounted(relative: str) -> None:
        refuse(relative, f"is a mount point (a bind mount or another file system inside the folder); "
                         f"{OWN_FILES_ONLY}: copy what publish needs into the folder instead.")  # fmt: skip

    inside = sorted(point for point in mount_points() if Path(point) != root and root in Path(point).parents)
    if inside:
        mounted(os.path.relpath(inside[0], root))
    own_device = os.stat(root).st_dev
    hard_linked: dict[tuple[int, int], list[str]] = {}
    for directory, subfolders, files in os.walk(root, onerror=unreadable, followlinks=False):
        for name in sorted(subfolders + files):
            path = os.path.join(directory, name)
            relative = os.path.relpath(path, root)
            status = os.lstat(path)
            if stat.S_ISLNK(status.st_mode):
                target = Path(os.path.realpath(path))
                if target != root and root not in target.parents:
                    refuse(relative, f"is a symbolic link to {target}, outside the folder; {OWN_FILES_ONLY}: replace "
                                     "the link by a copy of what it points to.")  # fmt: skip
                try:
                    os.path.realpath(path, strict=True)
                except OSError as error:
                    what = "a loop of symbolic links" if error.errno == errno.ELOOP else "a link to nothing"
                    refuse(relative, f"is {what} ({os.readlink(path)}), which publish would skip; remove it or put "
                                     "the file there.")  # fmt: skip
                continue
            if stat.S_ISDIR(status.st_mode):
                if status.st_dev != own_device or os.path.ismount(path):  # also where mountinfo would not show it
                    mounted(relative)
            elif stat.S_ISREG(status.st_mode):
                if status.st_nlink > 1:
                    hard_linked.setdefault((status.st_dev, status.st_ino), []).append(relative)
            else:
                refuse(relative, "is not a regular file; remove it or put a file there.")
    for names in hard_linked.values():
        links = os.lstat(root / names[0]).st_nlink
        if len(names) < links:
            refuse(names[0], f"is a hard link: the file has {links} names, {links - len(names)} of them outside the "
                             f"folder, so its content is not the folder's own; {OWN_FILES_ONLY}: replace it by a "
                             f"copy (cp {names[0]} {names[0]}.copy && mv {names[0]}.copy {names[0]}).")  # fmt: skip
