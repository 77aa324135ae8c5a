"""Builds gspo_kernels and, where the sources are present, its C++/CUDA extension."""

from setuptools import setup

setup()
