"""Native (numba) kernels of the hot loops: the receiver's decode-and-apply of ``xor-sparse2``
frames (:mod:`deltastore.kernels.apply`), the publisher's detect-and-encode
(:mod:`deltastore.kernels.detect`) and the memory floor the bench measures them against
(:mod:`deltastore.kernels.floor`).

Every kernel is compiled with ``nogil=True`` (threads run them in parallel, and a Python thread
beside them, an engine's scheduler, keeps the interpreter) and ``cache=True`` (compiled once per
environment, next to the module; later processes load the machine code in milliseconds).
Nothing here is imported by ``import deltastore`` or by the CLI's start-up: numba is imported
when a kernel module is, on first use. Words are unsigned little-endian integers of 1, 2, 4 or
8 bytes; positions are element indices. The numpy code each kernel replaces stays in the
package as its reference implementation, which the tests compare the kernel against bit for
bit.
"""
