"""specd's CPU kernels: forwards of a few rows off MLX, for the verifier's target and the
drafters' small models alike. MLX's CPU build runs a decode-sized product as a full matrix
product; these run it as row products on numpy and the compiled `_row_kernels.c` (built with the
package when a C compiler is there; numpy otherwise).

  row_products.py  the compiled products, or numpy's, on float32 or float16-stored weights
  gemv.py          a model's linear layers computing few-row inputs with those products
  half.py          weights that float16 holds exactly, kept half (half the bytes to read)
  llama.py         whole Llama-family layers (attention, RoPE, norms) on numpy
"""

# float32 copies of a model's half weights for MLX's products, up to this many bytes in all (the
# embedded model's: 513 MiB; none for a target the verifier's CPU layers run, prompts
# too); a larger model converts at each product instead, so its weights keep to half
# the memory. Here, not in half.py, so the verifier's help can name it without MLX.
FLOAT32_COPIES_BYTES = 1 << 30

# paired copies of the half weights the verifier's few-row forwards read (specd.cpu.row_products),
# up to this many bytes in all (the embedded model's: 257 MiB); past it they stay unpaired.
PAIRED_COPIES_BYTES = 1 << 30
