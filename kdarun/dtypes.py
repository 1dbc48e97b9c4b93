"""The element types of every buffer, as NumPy dtypes (bf16 is `ml_dtypes.bfloat16`)."""

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
U32 = np.dtype(np.uint32)
I32 = np.dtype(np.int32)
