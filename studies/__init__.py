"""Studies: the runs behind the docs' findings (the study's scale and its sensitivity, what a peak is made of,
run-to-run spread, CPU-vs-GPU fidelity, the driver's segment layout, the attention path's weight).

Run each as a module from the checkout's root (``python -m studies.study_scale --jobs 2 --out DIR``). Timings are in
``benchmarks/``, the generators of the README's and docs' tables in ``doctables/``."""
