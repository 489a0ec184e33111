"""Operators: registry of replacement modules, one file per operator family."""
from .base import BuildContext, NoOptions, Operator, module_matches
from .registry import KEEP, get, make_options, names, register

__all__ = ["BuildContext", "NoOptions", "Operator", "module_matches", "KEEP", "get", "make_options",
           "names", "register"]
