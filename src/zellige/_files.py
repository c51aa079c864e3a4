"""Reading inputs and writing outputs, the same way for every command.

Inputs are read up to MAX_INPUT_BYTES, so `--batch /dev/zero` is refused instead of filling the
memory. Outputs are checked before any work is done (their directory exists and is writable, they
are not one of the command's inputs) and written atomically: a temporary file in the same
directory, then a rename over the target. A reader never sees a half-written file, a failed
write leaves the previous file intact (and names the file), and a symbolic link at the output path
is replaced by the new file (its target is never written through). A device, FIFO or socket is
never an output. A temporary left by a writer killed mid-write is removed by the next write.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

MAX_INPUT_BYTES = 256 << 20  # 256 MiB: a batch of the largest allowed size fits with room to spare
MAX_TOML_BYTES = 1 << 20  # run files and model specs: a few dozen keys


def read_input(path: str | Path, max_bytes: int = MAX_INPUT_BYTES, what: str = "input") -> str:
    """The UTF-8 text of an input file; one-line ValueError when unreadable or over max_bytes."""
    try:
        with open(path, "rb") as file:
            data = file.read(max_bytes + 1)
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(data) > max_bytes:
        limit = f"{max_bytes >> 20} MiB" if max_bytes >= 1 << 20 else f"{max_bytes >> 10} KiB"
        raise ValueError(f"{path}: larger than the {limit} limit on {what} files")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a UTF-8 text file ({e.reason})") from None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_outputs(outputs: dict[str, str | Path | None], inputs: dict[str, str | Path | None]):
    """Fails before any work when an output (flag -> path, None = not asked for) cannot be
    written: its directory is missing or not writable, it is a directory, it is one of the inputs
    (flag -> path) or another output."""
    given = {flag: Path(path) for flag, path in outputs.items() if path is not None}
    for flag, path in given.items():
        if path.is_dir() and not path.is_symlink():
            raise ValueError(f"{flag} {path}: is a directory (give a file name)")
        if not path.is_symlink() and path.exists() and not path.is_file():
            # a rename would replace the device, FIFO or socket itself (/dev/null as root)
            raise ValueError(f"{flag} {path}: not a regular file (a device, FIFO or socket)")
        parent = path.absolute().parent
        if not parent.is_dir():
            raise ValueError(f"{flag} {path}: directory {parent} does not exist")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {path}: directory {parent} is not writable")
        for input_flag, input_path in inputs.items():
            if input_path is not None and _same_file(path, Path(input_path)):
                raise ValueError(
                    f"{flag} {path} is the {input_flag} input: refusing to overwrite an input"
                )
    names = list(given.items())
    for i, (flag, path) in enumerate(names):
        for other_flag, other in names[i + 1 :]:
            if path.absolute() == other.absolute() or _same_file(path, other):
                raise ValueError(f"{flag} and {other_flag} name the same file {path}")


def write_output(path: str | Path, data: str | bytes) -> None:
    """Writes `data` to `path` atomically (temporary file + rename; see the module docstring)."""
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    # A new file gets the mode an ordinary write would give it; an existing one keeps its own.
    try:
        mode = path.stat().st_mode & 0o7777 if not path.is_symlink() else None
    except FileNotFoundError:
        mode = None
    if mode is None:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    parent = path.absolute().parent
    _remove_dead_temporaries(parent, path.name)
    fd, temp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(payload)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temp, mode)
        os.replace(temp, path)
    except OSError as error:  # no space left ...: say which file could not be written
        Path(temp).unlink(missing_ok=True)
        raise OSError(error.errno, error.strerror or str(error), str(path)) from None
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _remove_dead_temporaries(directory: Path, name: str) -> None:
    """Removes the temporaries of earlier writes of `name` whose process is gone (killed
    mid-write: kill -9 runs no cleanup). A temporary is .NAME.PID.XXXXXXXX.tmp."""
    prefix = f".{name}."
    try:
        entries = [e for e in os.listdir(directory) if e.startswith(prefix) and e.endswith(".tmp")]
    except OSError:
        return
    for entry in entries:
        pid = entry[len(prefix) :].split(".", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            (directory / entry).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True
