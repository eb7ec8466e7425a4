from typing import Any

def read_many(
    fds: Any, offsets: Any, lengths: Any, dest: Any, dest_offsets: Any
) -> tuple[int, int, int]: ...
