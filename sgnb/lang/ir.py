"""sglang.lang.ir's names that programs import: the ready-made regexes and the function class."""

from sgnb.function import SglFunction
from sgnb.primitives import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR

__all__ = ["REGEX_BOOL", "REGEX_FLOAT", "REGEX_INT", "REGEX_STR", "SglFunction"]
