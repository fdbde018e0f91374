#!/bin/sh
# Dependencies of the real-model test bed (tests/ports), on top of `pip install -e ".[torch,paddle]"`.
#
# `pip install transformers paddleformers==1.2.0` works but drags in ~80 packages (1.1 GB:
# librosa, numba, pyarrow, pandas, datasets, visualdl, modelscope, ...) and DOWNGRADES
# numpy 2.x to 1.26.4 (fast_dataindex pins numpy<=1.26.4). The modeling code needs only
# transformers plus four small modules, so paddleformers goes in without its dependencies.
# transformers is pinned to paddleformers 1.2.0's range (>=5.0,<5.4).
set -e
pip install "transformers==5.3.0" colorlog aistudio-sdk ml_dtypes omegaconf
pip install --no-deps "paddleformers==1.2.0"
