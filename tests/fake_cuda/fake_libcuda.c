// A logging stand-in for libcuda; tests/fake_cuda/__init__.py says how the tests load and read it.
// - Per "physical" GPU a UUID and a PCI bus id; STUB_VISIBLE=1,0 renumbers them as CUDA_VISIBLE_DEVICES does.
// - Primary contexts are reference-counted; the log says CREATED / DESTROYED, and whether a destroyed one
//   was left current.
// - Each VMM call logs the context current on the calling thread.
// - Injected failures: STUB_{CREATE,EXPORT,IMPORT}_FAIL_TYPE=1|8 (POSIX FD | FABRIC), STUB_EXPORT_FAIL_NTH=n,
//   STUB_SETACCESS_FAIL_DEV=d, STUB_HOSTREGISTER_FAIL=1; STUB_NO_RDMA_DEV=d: device d reports no GPUDirect RDMA
//   with VMM. STUB_UNMAP_SLEEP_MS=n: cuMemUnmap takes n ms (after logging), as a driver waiting for the GPU would.
// - STUB_LOG=FILE: where the log goes (stderr otherwise).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long u64;

#define ATTR_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED 110
#define CTX(dev) ((void*)(uintptr_t)(0x1000 + (dev)))

static __thread void* cur = 0;
static int refs[8];
static int nvis = -1, phys[8];
static int ncreate = 0, nexport = 0;

static FILE* L(void) {
    static FILE* f;
    if (!f) {
        const char* p = getenv("STUB_LOG");
        f = p ? fopen(p, "a") : stderr;
        setvbuf(f, NULL, _IONBF, 0);
    }
    return f;
}

static int envi(const char* n) {
    const char* v = getenv(n);
    return v ? atoi(v) : -1;
}

static void vis(void) {
    if (nvis >= 0) return;
    nvis = 0;
    const char* v = getenv("STUB_VISIBLE");
    if (!v) v = "0,1";
    char buf[64];
    snprintf(buf, 64, "%s", v);
    for (char* t = strtok(buf, ","); t && nvis < 8; t = strtok(NULL, ",")) phys[nvis++] = atoi(t);
}

#define CUR() fprintf(L(), "    [current ctx %p]\n", cur)

CUresult cuDriverGetVersion(int* v) { *v = 13000; return 0; }
CUresult cuInit(unsigned f) { fprintf(L(), "cuInit(%u)\n", f); return 0; }

CUresult cuGetErrorName(int e, const char** s) {
    static char buf[64];
    snprintf(buf, 64, "CUDA_ERROR_STUB_%d", e);
    *s = buf;
    return 0;
}
CUresult cuGetErrorString(int e, const char** s) { return cuGetErrorName(e, s); }

CUresult cuDeviceGetCount(int* c) { vis(); *c = nvis; return 0; }
CUresult cuDeviceGet(int* d, int o) {
    vis();
    if (o < 0 || o >= nvis) return 101;
    *d = o;
    return 0;
}

CUresult cuDeviceGetAttribute(int* pi, int attr, int dev) {
    *pi = (attr == ATTR_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED && envi("STUB_NO_RDMA_DEV") == dev) ? 0 : 1;
    fprintf(L(), "cuDeviceGetAttribute(attr=%d, dev=%d)\n", attr, dev);
    return 0;
}

CUresult cuDeviceGetUuid_v2(unsigned char* u, int dev) {
    vis();
    memset(u, 0, 16);
    u[0] = 0xAA;
    u[15] = (unsigned char)phys[dev];
    fprintf(L(), "cuDeviceGetUuid(dev=%d -> phys %d)\n", dev, phys[dev]);
    return 0;
}
CUresult cuDeviceGetUuid(unsigned char* u, int dev) { return cuDeviceGetUuid_v2(u, dev); }

CUresult cuDeviceGetPCIBusId(char* buf, int len, int dev) {
    vis();
    snprintf(buf, len, "0000:%02X:00.0", 0x18 + phys[dev]);
    fprintf(L(), "cuDeviceGetPCIBusId(dev=%d) -> %s\n", dev, buf);
    return 0;
}

CUresult cuDevicePrimaryCtxRetain(void** ctx, int dev) {
    *ctx = CTX(dev);
    if (refs[dev]++ == 0) fprintf(L(), "  ** primary ctx dev %d CREATED\n", dev);
    fprintf(L(), "cuDevicePrimaryCtxRetain(dev=%d) refs=%d\n", dev, refs[dev]);
    return 0;
}
CUresult cuDevicePrimaryCtxRelease_v2(int dev) {
    refs[dev]--;
    const char* gone = refs[dev] == 0 ? "  ** DESTROYED" : "";
    fprintf(L(), "cuDevicePrimaryCtxRelease(dev=%d) refs=%d%s\n", dev, refs[dev], gone);
    if (refs[dev] == 0 && cur == CTX(dev)) fprintf(L(), "  !! destroyed ctx still current\n");
    return 0;
}
CUresult cuDevicePrimaryCtxRelease(int dev) { return cuDevicePrimaryCtxRelease_v2(dev); }
CUresult cuDevicePrimaryCtxGetState(int dev, unsigned* flags, int* active) {
    *flags = 0;
    *active = refs[dev] > 0;
    fprintf(L(), "cuDevicePrimaryCtxGetState(dev=%d) active=%d\n", dev, *active);
    return 0;
}

CUresult cuCtxSetCurrent(void* ctx) { fprintf(L(), "cuCtxSetCurrent(%p)\n", ctx); cur = ctx; return 0; }
CUresult cuCtxGetCurrent(void** ctx) { *ctx = cur; return 0; }
CUresult cuCtxSynchronize(void) { fprintf(L(), "cuCtxSynchronize()\n"); CUR(); return cur ? 0 : 201; }

// CUmemAllocationProp: type@0, requestedHandleTypes@4, location.type@8, location.id@12,
// win32HandleMetaData@16, allocFlags.compressionType@24, allocFlags.gpuDirectRDMACapable@25.
CUresult cuMemGetAllocationGranularity(size_t* g, const int* prop, int opt) {
    fprintf(L(), "cuMemGetAllocationGranularity(opt=%d, handleTypes=%d, dev=%d)\n", opt, prop[1], prop[3]);
    CUR();
    *g = 2u << 20;
    return 0;
}
CUresult cuMemCreate(u64* h, size_t size, const int* prop, u64 flags) {
    fprintf(L(), "cuMemCreate(size=%zu, handleTypes=%d, dev=%d, gpuDirectRDMACapable=%d)\n", size, prop[1], prop[3],
            ((const unsigned char*)prop)[25]);
    CUR();
    if (envi("STUB_CREATE_FAIL_TYPE") == prop[1]) return 801;
    *h = 0xABC0 + (ncreate++);
    return 0;
}
CUresult cuMemExportToShareableHandle(void* out, u64 h, int type, u64 flags) {
    nexport++;
    fprintf(L(), "cuMemExportToShareableHandle(h=%#llx, type=%d) #%d\n", h, type, nexport);
    CUR();
    int nth = envi("STUB_EXPORT_FAIL_NTH");
    if (envi("STUB_EXPORT_FAIL_TYPE") == type && (nth < 0 || nth == nexport)) {
        fprintf(L(), "  -> FAIL\n");
        return 801;
    }
    if (type == 1) {
        int fd = memfd_create("stubvmm", 0);
        *(int*)out = fd;
        fprintf(L(), "  -> fd %d\n", fd);
    } else if (type == 8) {
        unsigned char* p = out;
        for (int i = 0; i < 64; i++) p[i] = (unsigned char)(0xA0 + i);
    }
    return 0;
}
CUresult cuMemImportFromShareableHandle(u64* h, void* os, int type) {
    fprintf(L(), "cuMemImportFromShareableHandle(type=%d)\n", type);
    CUR();
    if (type == 1) {
        int fd = (int)(intptr_t)os;
        fprintf(L(), "  fd %d valid=%d\n", fd, fcntl(fd, F_GETFD) != -1);
    } else if (type == 8) {
        fprintf(L(), "  fabric[0]=%02x [63]=%02x\n", ((unsigned char*)os)[0], ((unsigned char*)os)[63]);
    }
    if (envi("STUB_IMPORT_FAIL_TYPE") == type) return 801;
    *h = 0xDEF0;
    return 0;
}
CUresult cuMemRelease(u64 h) { fprintf(L(), "cuMemRelease(%#llx)\n", h); CUR(); return 0; }
CUresult cuMemAddressReserve(u64* ptr, size_t size, size_t align, u64 addr, u64 flags) {
    fprintf(L(), "cuMemAddressReserve(size=%zu, align=%zu)\n", size, align);
    CUR();
    *ptr = 0x7f0000000000ULL;
    return 0;
}
CUresult cuMemMap(u64 ptr, size_t size, size_t off, u64 h, u64 flags) {
    fprintf(L(), "cuMemMap(ptr=%#llx, size=%zu, off=%zu, h=%#llx)\n", ptr, size, off, h);
    CUR();
    return 0;
}
CUresult cuMemSetAccess(u64 ptr, size_t size, const int* desc, size_t count) {
    fprintf(L(), "cuMemSetAccess(ptr=%#llx, size=%zu, dev=%d, flags=%d)\n", ptr, size, desc[1], desc[2]);
    CUR();
    return envi("STUB_SETACCESS_FAIL_DEV") == desc[1] ? 217 : 0;
}
CUresult cuMemUnmap(u64 ptr, size_t size) {
    fprintf(L(), "cuMemUnmap(%#llx, %zu)\n", ptr, size);
    CUR();
    if (envi("STUB_UNMAP_SLEEP_MS") > 0) usleep(1000 * envi("STUB_UNMAP_SLEEP_MS"));
    return 0;
}
CUresult cuMemAddressFree(u64 ptr, size_t size) { fprintf(L(), "cuMemAddressFree(%#llx, %zu)\n", ptr, size); return 0; }

CUresult cuMemHostRegister_v2(void* p, size_t size, unsigned flags) {
    fprintf(L(), "cuMemHostRegister(%p, size=%zu, flags=%u)\n", p, size, flags);
    CUR();
    return envi("STUB_HOSTREGISTER_FAIL") == 1 ? 712 : 0;  // CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
}
CUresult cuMemHostRegister(void* p, size_t size, unsigned flags) { return cuMemHostRegister_v2(p, size, flags); }
CUresult cuMemHostUnregister(void* p) { fprintf(L(), "cuMemHostUnregister(%p)\n", p); CUR(); return 0; }

// cuda-bindings resolves every entry point through here: answer with this library's own symbols.
CUresult cuGetProcAddress_v2(const char* sym, void** pfn, int ver, u64 flags, int* status) {
    static void* self;
    if (!self) self = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    char name[256];
    void* f = NULL;
    if (self) {
        snprintf(name, 256, "%s_v2", sym);
        f = dlsym(self, name);
        if (!f) f = dlsym(self, sym);
    }
    if (f == (void*)cuGetProcAddress_v2 && strcmp(sym, "cuGetProcAddress")) f = NULL;
    *pfn = f;
    if (status) *status = f ? 0 : 1;
    return f ? 0 : 500;
}
CUresult cuGetProcAddress(const char* sym, void** pfn, int ver, u64 flags, int* status) {
    return cuGetProcAddress_v2(sym, pfn, ver, flags, status);
}
