"""The GPU check (`bench/gpu/run.sh`): kernel cases on the device, paged-decode bandwidth, engine decode.

Run as modules (`python -m specfleet.bench.gpu.gpu_check`); the kernel tests share `paged_cases` with it."""
