"""Files the operator names on the command line: the directory a new key goes into."""

from __future__ import annotations

from pathlib import Path

from node.base.errors import CliError


def ensure_key_directory(path: Path) -> None:
    """Create the directory ``path`` (a key file about to be written) lives in, for its owner only
    (0700, as ``~/.ssh``), and its missing parents as ``mkdir -p`` would; an existing directory
    is left as it is. A path that cannot be created is one ``CliError`` naming it and the reason."""
    if path.parent.is_dir():
        return
    try:
        path.parent.mkdir(parents=True, mode=0o700)
    except FileExistsError:
        raise CliError(f"cannot create directory {path.parent}: a file of that name is in the way") from None
    except OSError as e:
        raise CliError(f"cannot create directory {path.parent}: {e.strerror}") from None
