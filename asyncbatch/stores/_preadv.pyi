from typing import Any

def read_many(
    fds: Any, offsets: Any, lengths: Any, dest: Any, dest_offsets: Any
) -> tuple[int, int, int]: ...
def map_file(fd: int, length: int) -> int: ...
def unmap_file(address: int, length: int) -> None: ...
def copy_many(
    bases: Any, limits: Any, offsets: Any, lengths: Any, dest: Any, dest_offsets: Any
) -> tuple[int, int, int]: ...
def conversion_versions() -> list[str]: ...
def gather(
    bases: Any,
    limits: Any,
    ends: Any,
    headers: Any,
    itemsize: int,
    starts: Any,
    window: int,
    dest: Any,
    convert: str = ...,
) -> tuple[int, int, int, int, int]: ...
