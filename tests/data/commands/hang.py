"""Sleeps forever inside phase `wait`: a hang to be killed at the timeout and named."""

import time

import torch

import pytest_rlhfmem as rlhfmem

weights = torch.zeros(1024, 1024)
with rlhfmem.phase("wait"):
    while True:
        time.sleep(1)
