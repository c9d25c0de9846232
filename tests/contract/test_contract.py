"""Every registered task's `tiny` preset through train, resume, eval, export and (where it generates)
sample, in-process on CPU: the contract of trainer/task.py holds for each family (`trainer.testing.check_task_contract`,
which a family in a package of its own calls from its tests too)."""

import pytest

from trainer.registry import available_tasks
from trainer.testing import check_task_contract

pytestmark = pytest.mark.usefixtures("fresh_accelerate")


# The alignment's case draws groups of rollouts through all T steps of a trained-size model: `extended`, with
# tests/families/molecules_edm/test_align_task.py (T = 20) as its lean stand-in for train, resume, export and sample.
CONTRACT_CASES = [pytest.param(name, marks=pytest.mark.extended) if name == "molecules_edm_align" else name
                  for name in available_tasks()]


@pytest.mark.slow
@pytest.mark.parametrize("name", CONTRACT_CASES)
def test_tiny_preset_train_resume_eval_export_sample(name, tmp_path):
    check_task_contract(name, tmp_path)
