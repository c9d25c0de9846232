"""The crystal family's Python API under the name the ComFormer seed's users import.

`from trainer.crystals import train_from_list, train_from_extxyz` keeps working; the code lives in
`trainer.families.crystals.api`.
"""

from trainer.families.crystals.api import read_results, train_from_extxyz, train_from_list, write_structures_extxyz

__all__ = ["read_results", "train_from_extxyz", "train_from_list", "write_structures_extxyz"]
