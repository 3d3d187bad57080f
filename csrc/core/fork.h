// Which side of a fork the process is on, for objects that belong to the process that
// made them: lanes (their threads do not exist in a child) and their futures.
#pragma once

namespace pydflash {

/// Bumped in every forked child; starts at 0. A relaxed atomic load: getpid() is a
/// system call, too slow for each submit.
int fork_generation();

}  // namespace pydflash
