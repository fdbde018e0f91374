"""The folder ``twinstep run`` puts first on PYTHONPATH: it holds only ``sitecustomize.py``."""
