// The int16 prefill product probe (docs/performance.md, "Where the rest of the gap is").
//
// y (M, N) = x (M, K) @ (s q + b)^T for affine codes q (here 5-bit values) in groups of 32,
// computed the way llama.cpp's prompt processing gets its speed: x rounded to int16 per row
// and group of 32 (its scale amax / 32767), the codes repacked as int16 [group][pair of k][16
// outputs][2], and AVX-512 VNNI's vpdpwssd (32 products a zmm instruction, into int32 lanes);
// each group's sums converted and scaled (s x_scale) into float32 totals, the biases' term
// b * sum(x) added per group. Against a float64 reference: the error it costs. Compare with
// numpy's float32 product (OpenBLAS) of the same shapes (the command below prints both).
//
//   gcc -O3 -march=cooperlake -fopenmp tools/vnni_gemm_probe.c -o /tmp/vnni_gemm_probe -lm
//   /tmp/vnni_gemm_probe 128 2048 640      # M N K (N a multiple of 32, K of 32, M of 4)
//
// A probe, not a kernel: the repack and x's rounding are plain scalar loops, and nothing here
// is built into mlxinfer.
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <math.h>
#include <string.h>
#include <time.h>
#include <omp.h>
double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define GS 32
int M=128,N=2048,K=640;
int main(int argc,char**argv){
  if(argc>3){M=atoi(argv[1]);N=atoi(argv[2]);K=atoi(argv[3]);}
  int G=K/GS;
  float*x=malloc(4L*M*K); uint8_t*q=malloc((long)N*K); float*s=malloc(4L*N*G),*b=malloc(4L*N*G);
  srand(1);
  for(long i=0;i<(long)M*K;i++) x[i]=((rand()%20001)-10000)/5000.0f;
  for(long i=0;i<(long)N*K;i++) q[i]=rand()%32;
  for(long i=0;i<(long)N*G;i++){ s[i]=0.001f+(rand()%1000)*1e-6f; b[i]=-16*s[i]; }
  // reference (double)
  double*ref=malloc(8L*M*N);
  for(int m=0;m<M;m++) for(int n=0;n<N;n++){ double a=0; for(int k=0;k<K;k++) a+=(double)x[(long)m*K+k]*((double)s[n*G+k/GS]*q[(long)n*K+k]+b[n*G+k/GS]); ref[(long)m*N+n]=a;}
  // repack weights: tile of 32 n: [g][p16][v2][16n][2]
  int NT=N/32;
  int16_t*W=aligned_alloc(64,2L*N*K);
  float*ST=aligned_alloc(64,4L*N*G),*BT=aligned_alloc(64,4L*N*G); // [tile][g][32]
  int16_t*XQ=aligned_alloc(64,2L*M*K); float*SX=malloc(4L*M*G),*XS=malloc(4L*M*G);
  float*y=aligned_alloc(64,4L*M*N);
  double best=1e9,bprep=1e9,bpack=1e9;
  for(int rep=0;rep<30;rep++){
   double t0=now();
   #pragma omp parallel for num_threads(2)
   for(int t=0;t<NT;t++){
     for(int g=0;g<G;g++) for(int p=0;p<16;p++) for(int v=0;v<2;v++) for(int j=0;j<16;j++) for(int e=0;e<2;e++){
       int n=t*32+v*16+j, k=g*GS+2*p+e;
       W[(((long)t*G+g)*16+p)*64 + v*32 + j*2 + e] = q[(long)n*K+k];
     }
     for(int g=0;g<G;g++) for(int j=0;j<32;j++){ ST[((long)t*G+g)*32+j]=s[(t*32+j)*G+g]; BT[((long)t*G+g)*32+j]=b[(t*32+j)*G+g]; }
   }
   double t1=now();
   #pragma omp parallel for num_threads(2)
   for(int m=0;m<M;m++) for(int g=0;g<G;g++){
     const float*xr=x+(long)m*K+g*GS; float a=0,sum=0; for(int k=0;k<GS;k++){ a=fmaxf(a,fabsf(xr[k])); sum+=xr[k]; }
     float sc=a>0?a/32767.0f:1.0f, inv=1.0f/sc; SX[m*G+g]=sc; XS[m*G+g]=sum;
     for(int k=0;k<GS;k++) XQ[(long)m*K+g*GS+k]=(int16_t)lrintf(xr[k]*inv);
   }
   double t2=now();
   #pragma omp parallel for num_threads(2) schedule(static)
   for(int t=0;t<NT;t++){
     for(int m0=0;m0<M;m0+=4){
       __m512 C[4][2]; for(int r=0;r<4;r++){C[r][0]=C[r][1]=_mm512_setzero_ps();}
       for(int g=0;g<G;g++){
         __m512i A[4][2]; for(int r=0;r<4;r++){A[r][0]=A[r][1]=_mm512_setzero_si512();}
         const int16_t*wp=W+((long)t*G+g)*16*64;
         for(int p=0;p<16;p++){
           __m512i w0=_mm512_load_si512(wp+p*64), w1=_mm512_load_si512(wp+p*64+32);
           for(int r=0;r<4;r++){
             __m512i xb=_mm512_set1_epi32(*(const int32_t*)(XQ+(long)(m0+r)*K+g*GS+2*p));
             A[r][0]=_mm512_dpwssd_epi32(A[r][0],xb,w0);
             A[r][1]=_mm512_dpwssd_epi32(A[r][1],xb,w1);
           }
         }
         __m512 s0=_mm512_load_ps(ST+((long)t*G+g)*32), s1=_mm512_load_ps(ST+((long)t*G+g)*32+16);
         __m512 b0=_mm512_load_ps(BT+((long)t*G+g)*32), b1=_mm512_load_ps(BT+((long)t*G+g)*32+16);
         for(int r=0;r<4;r++){
           __m512 sx=_mm512_set1_ps(SX[(m0+r)*G+g]), xs=_mm512_set1_ps(XS[(m0+r)*G+g]);
           C[r][0]=_mm512_fmadd_ps(_mm512_cvtepi32_ps(A[r][0]),_mm512_mul_ps(s0,sx),_mm512_fmadd_ps(b0,xs,C[r][0]));
           C[r][1]=_mm512_fmadd_ps(_mm512_cvtepi32_ps(A[r][1]),_mm512_mul_ps(s1,sx),_mm512_fmadd_ps(b1,xs,C[r][1]));
         }
       }
       for(int r=0;r<4;r++){ _mm512_storeu_ps(y+(long)(m0+r)*N+t*32,C[r][0]); _mm512_storeu_ps(y+(long)(m0+r)*N+t*32+16,C[r][1]); }
     }
   }
   double t3=now();
   if(t3-t2<best)best=t3-t2; if(t2-t1<bprep)bprep=t2-t1; if(t1-t0<bpack)bpack=t1-t0;
  }
  double maxrel=0,maxabs=0,refmax=0; for(long i=0;i<(long)M*N;i++){ double d=fabs(y[i]-ref[i]); if(d>maxabs)maxabs=d; if(fabs(ref[i])>refmax)refmax=fabs(ref[i]);}
  printf("M%d N%d K%d: gemm %.3f ms (%.1f GMAC/s), xprep %.3f ms, repack(naive) %.3f ms; max abs err %.2e of max |y| %.2e\n",M,N,K,best*1e3,(double)M*N*K/best/1e9,bprep*1e3,bpack*1e3,maxabs,refmax);
}
