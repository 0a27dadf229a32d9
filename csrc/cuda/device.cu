/* device.cu: the GPU itself: error names, what device is there, memory and copies.
 *
 * Thin wrappers over the CUDA runtime, so that the binding (plain C, built without CUDA
 * headers) never calls it directly. kvlab uses the current device (device 0 unless the
 * process chose another) and the default stream: every call runs in order, and the only
 * waits are the copies back to the host.
 */
#include <string.h>

#include "common.cuh"

extern "C" const char *kv_cuda_error_name(kv_cuda_err err) {
    return cudaGetErrorName((cudaError_t)err);
}

extern "C" const char *kv_cuda_error_string(kv_cuda_err err) {
    return cudaGetErrorString((cudaError_t)err);
}

extern "C" kv_cuda_err kv_cuda_device_count(int *count) {
    *count = 0;
    return (kv_cuda_err)cudaGetDeviceCount(count);
}

extern "C" kv_cuda_err kv_cuda_device_info(char *name, size_t name_size, int *major, int *minor,
                                           size_t *total_memory, int *multiprocessors,
                                           int *runtime_version, int *driver_version) {
    int device = 0;
    cudaDeviceProp prop;
    kv_cuda_err err = (kv_cuda_err)cudaGetDevice(&device);
    if (err == 0) err = (kv_cuda_err)cudaGetDeviceProperties(&prop, device);
    if (err == 0) err = (kv_cuda_err)cudaRuntimeGetVersion(runtime_version);
    if (err == 0) err = (kv_cuda_err)cudaDriverGetVersion(driver_version);
    if (err != 0) return err;
    if (name_size > 0) {
        strncpy(name, prop.name, name_size - 1);
        name[name_size - 1] = '\0';
    }
    *major = prop.major;
    *minor = prop.minor;
    *total_memory = prop.totalGlobalMem;
    *multiprocessors = prop.multiProcessorCount;
    return 0;
}

extern "C" kv_cuda_err kv_cuda_synchronize(void) {
    return (kv_cuda_err)cudaDeviceSynchronize();
}

extern "C" kv_cuda_err kv_cuda_alloc(void **ptr, size_t bytes) {
    *ptr = NULL;
    if (bytes == 0) return 0;
    kv_cuda_err err = (kv_cuda_err)cudaMalloc(ptr, bytes);
    if (err != 0) {
        *ptr = NULL;
        return err;
    }
    /* zero-filled, like the CPU core's calloc: an unwritten slot reads as 0, never as
     * whatever the last user of this memory left there */
    err = (kv_cuda_err)cudaMemset(*ptr, 0, bytes);
    if (err != 0) {
        cudaFree(*ptr);
        *ptr = NULL;
    }
    return err;
}

extern "C" void kv_cuda_free(void *ptr) {
    if (ptr != NULL) cudaFree(ptr);
}

extern "C" kv_cuda_err kv_cuda_to_device(void *device, const void *host, size_t bytes) {
    if (bytes == 0) return 0;
    return (kv_cuda_err)cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice);
}

extern "C" kv_cuda_err kv_cuda_to_host(void *host, const void *device, size_t bytes) {
    if (bytes == 0) return 0;
    return (kv_cuda_err)cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost);
}
