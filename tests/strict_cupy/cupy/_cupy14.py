"""What the real CuPy 14.2 has, read by introspection of cupy-cuda13x 14.2.0 (no GPU needed):
``pip install --target DIR cupy-cuda13x cuda-pathfinder nvidia-nccl-cu13``, then dir() and
``cupy._core._scalar.get_typename`` under ``PYTHONPATH=DIR``."""
# CuPy 14.2's dtype table (cupy._core._scalar.get_typename accepts these; bfloat16 is
# ml_dtypes.bfloat16, with ufunc loops 'EE->E'); others raise "Unsupported dtype"
DTYPES = frozenset(("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                    "float16", "float32", "float64", "complex64", "complex128", "bfloat16"))
# NumPy names that CuPy 14.2 does not have (dir(cupy) of the real package): AttributeError here too
NOT_IN_CUPY = frozenset("""False_ ScalarType True_ asmatrix block bmat busday_count busday_offset busdaycalendar
    bytes_ char character clongdouble complex256 core ctypeslib datetime64 datetime_as_string datetime_data dtypes
    einsum_path emath errstate f2py flexible float128 frompyfunc fromregex geomspace get_include getbufsize geterr
    geterrcall histogram_bin_edges info insert is_busday isnat little_endian longdouble ma matrix matvec memmap
    nanpercentile nanquantile ndenumerate nditer nested_iters object_ polyder polydiv polyint rec recarray record
    sctypeDict setbufsize seterr seterrcall show_runtime spacing str_ strings test timedelta64 typecodes unstack
    vecdot vecmat void""".split())
NDARRAY_NOT_IN_CUPY = frozenset(("ctypes", "getfield", "resize", "setfield", "setflags", "to_device"))
