"""sglang.lang.interpreter's names that programs import: the program state, its fork groups, the executor."""

from sgnb.interpreter import StreamExecutor
from sgnb.state import ProgramState, ProgramStateGroup

__all__ = ["ProgramState", "ProgramStateGroup", "StreamExecutor"]
